"""What walking a JSON Schema needs to know (JSON Schema 2020-12, RFC 6901): which keywords
hold data rather than subschemas, which map names to subschemas, which references point into
the schema itself, how a key is written in a JSON pointer, and the metaschema check. No
imports at load time: the ingress (``app.tool_calls``, ``app.protocol``) and the engine
(``engine.structured_outputs``) share it."""
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


def map_schema_objects(schema, change):
    """A copy of ``schema`` with ``change`` applied to each of its objects, innermost first
    (``change`` gets the object's copy, its parts already changed, and returns the new
    object). The values of ``DATA_KEYWORDS`` are left as they are, and the names under
    ``SCHEMA_MAPS`` are names, not keywords; ``schema`` itself is not changed."""
    if isinstance(schema, list):
        return [map_schema_objects(item, change) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {}
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            copy[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            copy[key] = {name: map_schema_objects(sub, change) for name, sub in value.items()}
        else:
            copy[key] = map_schema_objects(value, change)
    return change(copy)


def pointer_token(key) -> str:
    """``key`` as one JSON pointer token (RFC 6901: ``~`` as ``~0``, ``/`` as ``~1``)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def check_schema(schema) -> None:
    """``jsonschema``'s metaschema check of ``schema`` (a dict or bool): the draft its
    ``$schema`` names, else 2020-12 (also for an unknown one, which jsonschema would warn
    about on every call).

    Raises:
        jsonschema.SchemaError: ``path`` where the schema breaks its metaschema; ``message``
            (which quotes the schema) cut to 200 characters.
    """
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        if len(exc.message) > 200:
            exc.message = f"{exc.message[:200]}... ({len(exc.message)} characters)"
        raise
