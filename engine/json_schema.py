"""What walking a JSON Schema needs to know (JSON Schema 2020-12, RFC 6901): which keywords
hold data rather than subschemas, which map names to subschemas, which references point into
the schema itself, and how a key is written in a JSON pointer. No imports: the ingress
(``app.tool_calls``) and the engine (``engine.structured_outputs``) share it."""
from __future__ import annotations

# Keywords whose value is data, not a subschema: a "$ref" key in it is a value, no reference.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords that combine subschemas: beside one of them (or "$ref") xgrammar applies that alone.
COMBINATORS = ("anyOf", "oneOf", "allOf")
# Keywords whose value maps names (not keywords) to subschemas.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def is_local_ref(ref) -> bool:
    """Whether a ``$ref`` value is a JSON pointer into the schema itself: ``"#"`` or
    ``"#/..."`` (not an anchor ``"#foo"``, a URI, or ``""``)."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def pointer_token(key) -> str:
    """``key`` as one JSON pointer token (RFC 6901: ``~`` as ``~0``, ``/`` as ``~1``)."""
    return str(key).replace("~", "~0").replace("/", "~1")
