"""Structured outputs through xgrammar: constraints to grammars, a matcher per sequence, and
each step's token bitmask.

- ``StructuredOutputManager`` turns a request's ``StructuredOutputsParams`` into an
  xgrammar ``Grammar`` at once (cheap, no tokenizer: an invalid schema, regex or grammar is
  a ``ValueError`` when the request is added), then compiles it against the tokenizer on a
  worker thread (the expensive part: a token mask cache over the vocabulary), so that a
  slow compile holds back its own requests only: one worker compiles the usual constraints,
  another those over ``LARGE_CONSTRAINT_CHARS``, each in order, and a compile that no request
  waits for any more is dropped before it starts (``cancel_unwanted``). Compiled grammars are
  kept in an LRU cache keyed by the constraint; requests with the same constraint share one
  compile, even while it runs.
- ``SequenceGrammar`` is one sequence's matcher: it accepts each sampled token; forks of a
  request with ``n > 1`` fork their parent's matcher before it accepts its own token.
- ``GrammarBitmask`` fills the bitmasks of a step's constrained rows in one batched call
  (xgrammar's ``BatchGrammarMatcher``, C++ threads) for ``engine.sampler.apply_grammar_bitmask``.

Importing this module imports xgrammar (about a second with transformers): the engine does
it on its first constrained request.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any, Sequence

import pydantic
import torch
import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.json_schema import (
    COMBINATORS,
    DATA_KEYWORDS,
    SCHEMA_MAPS,
    check_schema,
    is_local_ref,
    map_schema_objects,
    pointer_token,
)
from engine.sampling_params import StructuredOutputsParams
from engine.scheduler_output import SamplingRow

GRAMMAR_CACHE_SIZE = 128  # distinct constraints kept compiled, least recently used dropped first
# Constraints whose text is longer than this compile on a worker of their own, so that a
# huge schema does not hold back everyone else's: a trial's 715 KB schema (4,000 properties
# of 20-value enums) compiled for 119 s, and a new regex waited behind it all that time. The
# schemas and regexes requests usually send are a few KB at most and compile in milliseconds
# to a second.
LARGE_CONSTRAINT_CHARS = 32 * 1024
# xgrammar's threads for one compile and for one step's bitmasks: half the cores (the
# forward's torch threads run beside them), at most 8 (its own default).
_NUM_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def grammar_of(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as an xgrammar ``Grammar`` (no tokenizer; milliseconds).

    Raises:
        InvalidRequestError: for a schema, regex, grammar or structural tag xgrammar cannot
            parse or does not support, naming ``structured_outputs.<field>`` and the reason.
    """
    kind = params.kind
    value = getattr(params, kind)
    any_whitespace = not params.disable_any_whitespace
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            check_enforceable(schema)
            return xgr.Grammar.from_json_schema(json.dumps(with_exact_formats(schema)), any_whitespace=any_whitespace)
        if kind == "json_object":  # any object: not strict, or {"type": "object"} allows only {}
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                strict_mode=False)
        if kind == "regex":
            _check_regex(value, "")
            return xgr.Grammar.from_regex(value)
        if kind == "choice":  # a JSON string literal is an EBNF one (same escapes)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        tag = json.loads(value)
        check_structural_tag(tag)
        return xgr.Grammar.from_structural_tag(json.dumps(with_exact_formats(tag, in_tag=True)))
    except (RuntimeError, ValueError, TypeError, pydantic.ValidationError) as exc:
        raise InvalidRequestError(f"structured_outputs.{kind}: {_reason(exc)}",
                                  f"structured_outputs.{kind}") from None


# What xgrammar 0.2 leaves unenforced in a JSON schema (any value passes it), measured by
# feeding its grammar a value the keyword forbids; tests/engine/test_structured_outputs.py
# keeps each fact true (test_keywords_xgrammar_does_not_enforce_are_refused). Refused rather than
# compiled: a constraint that is not enforced would hand the client output its schema refuses.
UNENFORCED_KEYWORDS = frozenset({"contains", "minContains", "maxContains", "dependencies", "dependentRequired",
                                 "dependentSchemas", "if", "then", "else", "not"})
# JSON Schema's formats whose strings xgrammar checks, and those it leaves unchecked. Other
# names ("binary", "password", "int32": pydantic's and OpenAPI's) are annotations, as JSON
# Schema has unknown formats.
ENFORCED_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                              "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer"})
UNCHECKED_FORMATS = frozenset({"regex", "idn-email", "idn-hostname", "iri", "iri-reference"})
# Formats whose xgrammar grammar lets through strings the format forbids, each as a pattern
# that does not (compiled in its place by with_exact_formats): xgrammar 0.2's "date" takes any
# day 01-31 in any month ("2022-02-30", "2023-02-29"), and so does "date-time"'s date; its
# "ipv4" takes leading zeros ("012.034.056.078"), which JSON Schema's test suite and Python's
# ipaddress refuse (they read as octal elsewhere). Dates follow RFC 3339 section 5.6 with the
# Gregorian leap years of its appendix C; a date-time's "T", "Z" and leap second 60 as there.
_DAY = ("([0-9]{4}-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
        "|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)")
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
EXACT_FORMATS = {
    "date": f"^{_DAY}$",
    "date-time": (f"^{_DAY}[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?"
                  "([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"),
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
}


def with_exact_formats(schema: Any, in_tag: bool = False) -> Any:
    """``schema`` with each ``"format"`` of ``EXACT_FORMATS`` replaced by its ``"pattern"``
    (a copy; ``schema`` itself is unchanged). ``check_enforceable`` has refused a format
    beside a pattern or a length already, so the pattern is the object's only string check.
    With ``in_tag``, ``schema`` is a structural tag: the JSON schemas inside it are changed."""
    if in_tag:
        if isinstance(schema, list):
            return [with_exact_formats(item, in_tag) for item in schema]
        if not isinstance(schema, dict):
            return schema
        return {key: with_exact_formats(value, in_tag=key != "json_schema") for key, value in schema.items()}
    return map_schema_objects(schema, _exact_format)


def _exact_format(node: dict) -> dict:
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in EXACT_FORMATS and "pattern" not in node:
        del node["format"]
        node["pattern"] = EXACT_FORMATS[fmt]
    return node


# In one schema object xgrammar applies "$ref" above all, then "enum" / "const", then a
# combinator (json_schema.COMBINATORS), and ignores every other assertion there.
# JSON Schema 2020-12's assertion and applicator keywords (+ draft 7's "dependencies" and
# "additionalItems"); anything else in a schema object is an annotation or unknown, and both
# are ignored by the specification too.
_ASSERTIONS = frozenset({
    "$ref", "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "contains", "items", "prefixItems", "additionalItems", "unevaluatedItems", "maxProperties", "minProperties",
    "required", "properties", "patternProperties", "additionalProperties", "propertyNames", "unevaluatedProperties",
    "dependentRequired", "dependentSchemas", "dependencies", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"})
# Keywords xgrammar applies only when "type" names their kind (or, for objects and arrays,
# "properties" / "items" imply it). "format" is not among them: on another type it is an
# annotation ("format": "int32" on an integer), as JSON Schema has it.
_TYPED = {"number": ("multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"),
          "string": ("maxLength", "minLength", "pattern"),
          "object": ("required", "maxProperties", "minProperties", "additionalProperties", "patternProperties",
                     "propertyNames", "unevaluatedProperties"),
          "array": ("maxItems", "minItems", "uniqueItems", "unevaluatedItems")}
# Where a schema object holds subschemas: one, a list of them, or a map of names to them.
_ONE_SCHEMA = frozenset({"items", "additionalItems", "unevaluatedItems", "contains", "additionalProperties",
                         "unevaluatedProperties", "propertyNames", "not", "if", "then", "else"})
_SCHEMA_LISTS = frozenset({"prefixItems", "allOf", "anyOf", "oneOf", "items"})


def check_enforceable(schema) -> None:
    """Refuse a JSON schema that xgrammar would compile but not enforce in full.

    - a schema its own metaschema refuses (``jsonschema``'s ``check_schema``, the draft its
      ``$schema`` names, else 2020-12): xgrammar compiles e.g. ``{"anyOf": []}`` (no value
      satisfies it) into a grammar of nothing, or ``{"type": []}`` into one of anything;
    - references: xgrammar resolves a ``$ref`` that is a JSON pointer into the schema itself
      (``"#"``, ``"#/$defs/Address"``); an anchor (``"#foo"``), a URI (against ``$id``), an
      empty reference and ``$dynamicRef`` / ``$recursiveRef`` it leaves unconstrained;
    - keywords it ignores: ``contains`` / ``minContains`` / ``maxContains``, ``dependencies``
      / ``dependentRequired`` / ``dependentSchemas``, ``if`` / ``then`` / ``else``, ``not``,
      ``uniqueItems: true``, ``allOf`` of more than one schema, ``multipleOf`` on a
      ``"number"`` or with a fractional divisor, a string ``format`` in ``UNCHECKED_FORMATS``
      (other unknown names are annotations);
    - keywords beside ``$ref``, ``anyOf``, ``oneOf`` or ``allOf`` in one schema object (it
      applies only the reference or the combinator; a ``type`` every branch has is allowed);
      beside ``enum`` / ``const`` only ``type``, bounds, lengths and ``format``, when every
      listed value satisfies them (no regular expression of the client's runs here);
    - ``minLength`` / ``maxLength`` beside a ``pattern`` or a checked ``format``, or those two
      together (it applies the pattern or the format alone);
    - a ``required`` key without a schema in ``properties``, and ``propertyNames`` /
      ``patternProperties`` beside ``properties``;
    - type-specific keywords (``minimum``, ``maxLength``, ``required``, ``format``, ...) in a
      schema object whose ``"type"`` does not name that kind.

    Args:
        schema: the decoded schema (dict; a boolean or anything else has nothing to check).

    Raises:
        ValueError: naming the first such keyword, its JSON pointer in ``schema`` and the fix.
    """
    _check_against_metaschema(schema)
    # (value, its JSON pointer, whether it is a schema: None if not, else the kind of value it
    # applies to when that is implied, "string" for propertyNames' schema, "" for any)
    stack = [(schema, "#", "")]
    while stack:
        item, where, kind = stack.pop()
        if isinstance(item, list):
            stack.extend((sub, f"{where}/{i}", None) for i, sub in enumerate(item))
            continue
        if not isinstance(item, dict):
            continue
        for key, sub in item.items():
            if key == "$ref" and isinstance(sub, str) and not is_local_ref(sub):
                raise ValueError(f"$ref {json.dumps(sub)} at {where}: only references into the schema "
                                 "itself (\"#\" or a JSON pointer \"#/...\") are supported")
            if key in ("$dynamicRef", "$recursiveRef"):
                raise ValueError(f"{key} at {where} is not supported; use $ref with a JSON pointer (\"#/...\")")
        if kind is not None:
            _check_keywords(item, where, kind)
        for key, sub in item.items():
            path = f"{where}/{pointer_token(key)}"
            if key in SCHEMA_MAPS and isinstance(sub, dict):
                stack.extend((value, f"{path}/{pointer_token(name)}", "") for name, value in sub.items())
            elif key in _SCHEMA_LISTS and isinstance(sub, list):
                stack.extend((value, f"{path}/{i}", "") for i, value in enumerate(sub))
            elif key not in DATA_KEYWORDS:
                schema_kind = ("string" if key == "propertyNames" else "") if key in _ONE_SCHEMA else None
                stack.append((sub, path, schema_kind if kind is not None else None))


def _check_against_metaschema(schema) -> None:
    """``ValueError`` naming the first place where ``schema`` breaks its metaschema."""
    if not isinstance(schema, (dict, bool)):
        return
    import jsonschema
    try:
        check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "#" + "".join(f"/{pointer_token(part)}" for part in exc.path)
        raise ValueError(f"not a valid JSON schema at {where}: {exc.message}") from None


def check_structural_tag(tag) -> None:
    """``check_enforceable`` for each JSON schema inside an xgrammar structural tag (a
    ``{"type": "json_schema", "json_schema": ...}`` format), and refuse the options that
    loosen one: ``any_order: true`` (a key may repeat, ``{"n": 1, "n": 2}``, and stand in for a
    required one) and ``excludes`` (xgrammar then drops ``minLength`` / ``maxLength``).

    Raises:
        ValueError: naming the format's JSON pointer in the tag and the problem.
    """
    stack = [(tag, "#")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, list):
            stack.extend((sub, f"{where}/{i}") for i, sub in enumerate(item))
        elif isinstance(item, dict):
            if "json_schema" in item:  # "json_schema" formats and the XML-styled ones (qwen_xml_parameter)
                if item.get("any_order"):
                    raise _not_enforced('"any_order": true', where,
                                        "a key may then repeat and stand in for a required one")
                if item.get("excludes"):
                    raise _not_enforced('"excludes"', where, "xgrammar drops minLength and maxLength with it")
                try:
                    check_enforceable(item["json_schema"])
                except ValueError as exc:
                    raise ValueError(f"the json_schema at {where}: {exc}") from None
                continue
            stack.extend((sub, f"{where}/{pointer_token(key)}") for key, sub in item.items())


_QUANTIFIER_START = frozenset("*+?{")


def unenforced_regex_part(pattern: str) -> str | None:
    """The first part of a regular expression that xgrammar compiles but does not enforce
    (a string it generates may not match), or ``None``:

    - a lookahead ``(?=`` / ``(?!`` (dropped from a JSON schema's ``pattern``: ``^(?=b)a+$``
      let ``"a"`` through) or a lookbehind;
    - a ``^`` that is not at the start of the match or a ``$`` not at its end (``a$b`` and
      ``^a^b`` generated ``"ab"``), or a quantifier on an anchor or on a group holding one;
      anchors at the start of the pattern, of its alternatives or of groups that themselves
      start it (``^a|^b``, ``(^a)``; mirrored for ``$``) are enforced;
    - a class ``[]...`` or ``[^]...`` (xgrammar, as ECMA, ends the class at that ``]``; Python
      takes it as a character), a class starting ``[\\^`` (xgrammar's regex reads it as
      ``[^``), and an escape of a ``LITERAL_ESCAPE_LETTERS`` letter (``\\A``: the letter).

    Measured on xgrammar in tests/engine/test_structured_outputs.py.
    """
    tokens = _regex_tokens(pattern)
    for token, _ in tokens:
        if token in ("(?=", "(?!", "(?<=", "(?<!"):
            return f"the lookaround {token!r}"
        if token in ("[]", "[^]"):
            return f"the class '{token}' (Python reads its ']' as a character, xgrammar as its end: write '\\]')"
        if token.startswith("[\\^"):
            return f"the class '{token}' (xgrammar's regex reads '[\\^' as '[^', a negated class: put '^' later)"
        escape = _literal_escape(token)
        if escape is not None:
            return f"the escape '{escape}' (xgrammar matches the letter '{escape[1]}' itself)"
    mirrored = [(token, _MIRRORED.get(kind, kind)) for token, kind in reversed(tokens)]
    return _misplaced_anchor("^", tokens) or _misplaced_anchor("$", mirrored) or _quantified_anchor(tokens)


_MIRRORED = {"open": "close", "close": "open"}
# Letters whose escape xgrammar 0.2 matches as the letter itself ("\A" matches "A"; Python
# gives them a meaning or refuses them), in a class too; measured in
# tests/engine/test_structured_outputs.py.
LITERAL_ESCAPE_LETTERS = "ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ"


def _literal_escape(token: str) -> str | None:
    """The first escape in ``token`` (an escape, or a class) of a ``LITERAL_ESCAPE_LETTERS``
    letter, or ``None``."""
    i = 0
    while i < len(token) - 1:
        if token[i] == "\\":
            if token[i + 1] in LITERAL_ESCAPE_LETTERS:
                return token[i:i + 2]
            i += 2
        else:
            i += 1
    return None


def _regex_tokens(pattern: str) -> list[tuple[str, str]]:
    """``(token, kind)``: kind ``open`` (``(`` and every ``(?...`` group, shown as ``(``
    except lookarounds), ``close``, ``|``, ``anchor``, ``quantifier`` or ``atom`` (a
    character, an escape, a class)."""
    tokens, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            tokens.append((pattern[i:i + 2], "atom"))
            i += 2
        elif char == "[":
            end, _ = _class_members(pattern, i)
            tokens.append((pattern[i:end], "atom"))
            i = end
        elif char == "(":
            lookaround = next((p for p in ("(?<=", "(?<!", "(?=", "(?!") if pattern.startswith(p, i)), None)
            tokens.append((lookaround or "(", "open"))
            i += len(lookaround) if lookaround else 1
            if not lookaround and pattern.startswith("?", i):  # (?:, (?P<n>, (?<n>, (?i): no atom
                j = i
                while j < len(pattern) and pattern[j] not in ":>)":
                    j += 1
                if pattern[j:j + 1] == ")":  # flags alone, "(?i)": zero width, no group
                    tokens.pop()
                i = j + 1
        elif char == ")":
            tokens.append((")", "close"))
            i += 1
        elif char == "|":
            tokens.append(("|", "|"))
            i += 1
        elif char in "^$":
            tokens.append((char, "anchor"))
            i += 1
        elif char in _QUANTIFIER_START and (char != "{" or pattern[i + 1:i + 2].isdigit()):
            j = pattern.find("}", i) + 1 if char == "{" else i + 1
            tokens.append((pattern[i:j or len(pattern)], "quantifier"))
            i = j or len(pattern)
        else:
            tokens.append((char, "atom"))
            i += 1
    return tokens


def _misplaced_anchor(anchor: str, tokens: list[tuple[str, str]]) -> str | None:
    """Walk ``tokens`` from the start of the match (for ``$``, the mirrored tokens from its
    end): ``anchor`` is enforced only where nothing can have been matched before it."""
    at_start, group_starts = True, []  # whether each open group starts at the start
    for token, kind in tokens:
        if kind == "open":
            group_starts.append(at_start)
        elif kind == "|":
            at_start = group_starts[-1] if group_starts else True
        elif kind == "close":
            if group_starts:
                group_starts.pop()
            at_start = False
        elif kind == "anchor" and token == anchor and not at_start:
            return f"{anchor!r} inside the match"
        elif kind == "atom":
            at_start = False
    return None


def _quantified_anchor(tokens: list[tuple[str, str]]) -> str | None:
    """A quantifier on an anchor or on a group that holds one (``(^a)*``)."""
    holds, previous = [], None  # holds: whether each open group holds an anchor
    for token, kind in tokens:
        if kind == "quantifier" and previous in ("anchor", "close with anchor"):
            return f"a quantifier {token!r} on an anchor"
        if kind == "open":
            holds.append(False)
        elif kind == "anchor" and holds:
            holds[-1] = True
        elif kind == "close":
            held = holds.pop() if holds else False
            if held and holds:
                holds[-1] = True
            kind = "close with anchor" if held else kind
        previous = kind
    return None


def _check_regex(pattern: str, where: str) -> None:
    """``ValueError`` for a regular expression with a part xgrammar does not enforce
    (``unenforced_regex_part``); ``where`` is its place in a schema ("" for a whole regex),
    where its matches are JSON strings, which must not hold ``json_unsafe_regex_part``."""
    part = unenforced_regex_part(pattern)
    if part is not None:
        raise ValueError(f"{part}{where} is not enforced by the grammar engine (xgrammar), so the output would "
                         "not be checked against it; rewrite the pattern without it (xgrammar enforces '^' "
                         "only at the start of the match, '$' only at its end, and no lookaround)")
    part = json_unsafe_regex_part(pattern) if where else None
    if part is not None:
        raise ValueError(f"{part}{where} would be written into the JSON string as it is, unescaped, by the grammar "
                         "engine (xgrammar): the output would not be valid JSON or would not match; a pattern in "
                         "a schema cannot match a quote, a backslash, a control character (U+0000-U+001F) or a "
                         "surrogate (U+D800-U+DFFF) here")


# What a JSON string cannot hold unescaped (RFC 8259 section 7): a quote, a backslash and the
# control characters U+0000-U+001F; and the surrogates U+D800-U+DFFF, which are no characters
# (xgrammar writes the bytes of their UTF-8-like form: three U+FFFD once decoded).
_SURROGATES = range(0xD800, 0xE000)
_JSON_UNSAFE = frozenset(range(0x20)) | {ord('"'), ord("\\")} | frozenset(_SURROGATES)
# Escapes of one character (ECMA-262's and Python's), outside a class; "\b" only inside one.
_CHARACTER_ESCAPES = {"a": 0x07, "e": 0x1B, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00}


def json_unsafe_regex_part(pattern: str) -> str | None:
    """The first part of a JSON schema's ``pattern`` that makes xgrammar write a character a
    JSON string must escape (``_JSON_UNSAFE``) into the output as it is, or ``None``:

    - such a character outside a class, as itself or as an escape (``"``, ``\\\\``, ``\\n``,
      ``\\x22``, ``\\u0022``): ``^a"b$`` gave ``{"p": "a"b"}``;
    - a class whose members are all such characters (``[\\n]``, ``[\\x00-\\x1f]``);
    - a surrogate, alone or in such a class (``^\\ud83d$`` gave three U+FFFD). (xgrammar's
      ``.``, negated and other classes take a surrogate's bytes too, as one choice among every
      character: not refused.)

    xgrammar drops these characters from other classes, negated ones, ``.`` and the
    shorthands (``[ -~]`` generates no ``"``); measured in tests/engine/test_structured_outputs.py.
    """
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            end, members = _class_members(pattern, i)
            if members is not None and members and all(_json_unsafe_range(*m) for m in members):
                return f"the class {pattern[i:end]!r}"
            i = end
            continue
        code, end = _character_at(pattern, i, in_class=False)
        if code in _JSON_UNSAFE:
            return f"the character {pattern[i:end]!r}"
        i = end
    return None


def _json_unsafe_range(low: int | None, high: int | None) -> bool:
    """Whether every character from ``low`` to ``high`` is one a JSON string must escape."""
    if low is None or high is None or low > high:
        return False
    return high < 0x20 or (low == high and low in _JSON_UNSAFE) or (low in _SURROGATES and high in _SURROGATES)


def _character_at(pattern: str, i: int, in_class: bool) -> tuple[int | None, int]:
    """``(code point, end)`` of the character ``pattern[i:end]`` denotes, raw or escaped;
    ``None`` for what is not one character (a class shorthand, an anchor, a group). The
    escapes Python's ``re`` refuses (ECMA's ``\\cA``, ``\\u{...}``) do not reach here: a
    schema's metaschema check refuses such a pattern first."""
    if pattern[i] != "\\":
        return (ord(pattern[i]) if in_class or pattern[i] not in "^$.|?*+()[]{}" else None), i + 1
    letter = pattern[i + 1:i + 2]
    digits = {"x": 2, "u": 4}.get(letter)
    if digits and _is_hex(pattern[i + 2:i + 2 + digits]) and len(pattern[i + 2:i + 2 + digits]) == digits:
        return int(pattern[i + 2:i + 2 + digits], 16), i + 2 + digits
    if letter in _CHARACTER_ESCAPES or (letter == "b" and in_class):
        return _CHARACTER_ESCAPES.get(letter, 0x08), i + 2
    if letter and not letter.isalnum():  # an escaped punctuation character: itself
        return ord(letter), i + 2
    return None, i + 2


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdefABCDEF" for c in text)


def _class_members(pattern: str, start: int) -> tuple[int, list[tuple[int | None, int | None]] | None]:
    """``(end, members)`` of the class at ``pattern[start]`` (``"["``): its characters and
    ranges as ``(low, high)`` code points, ``(None, None)`` for a shorthand; members ``None``
    for a negated class. A ``]`` right after ``[`` or ``[^`` ends it (as xgrammar reads it)."""
    i = start + 1
    negated = pattern[i:i + 1] == "^"
    i += negated
    members: list[tuple[int | None, int | None]] = []
    while i < len(pattern) and pattern[i] != "]":
        low, i = _character_at(pattern, i, in_class=True)
        if pattern[i:i + 1] == "-" and pattern[i + 1:i + 2] not in ("]", "") and low is not None:
            high, i = _character_at(pattern, i + 1, in_class=True)
            members.append((low, high))
        else:
            members.append((low, low))
    return i + 1, None if negated else members


def _not_enforced(keyword: str, where: str, fix: str) -> ValueError:
    return ValueError(f"{keyword} at {where} is not enforced by the grammar engine (xgrammar), so the output "
                      f"would not be checked against it; {fix}")


def _check_keywords(node: dict, where: str, implied_kind: str) -> None:
    """One schema object's keywords (``check_enforceable``); ``implied_kind`` is the kind of
    value it applies to where its place implies one ("string" in ``propertyNames``), else ""."""
    for key in node:
        if key in UNENFORCED_KEYWORDS:
            raise _not_enforced(json.dumps(key), where, "remove it")
    if node.get("uniqueItems") is True:
        raise _not_enforced('"uniqueItems": true', where, "remove it")
    if isinstance(node.get("items"), list):  # xgrammar refuses it with "items must be a boolean or an object"
        raise ValueError(f'"items" as an array (draft 7\'s tuple form) at {where} is not supported by the grammar '
                         'engine (xgrammar); write the same as "prefixItems" (draft 2020-12), with "items" in place '
                         'of "additionalItems"')
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise _not_enforced(f"allOf of {len(node['allOf'])} schemas", where, "merge them into one schema")
    declared = _names(node.get("type"))
    assertions = [key for key in node if key in _ASSERTIONS]
    listed = "enum" in node or "const" in node  # these win over a combinator, not over "$ref"
    for dominant in ("$ref",) + (() if listed else COMBINATORS):
        others = [key for key in assertions if key != dominant]
        if dominant in node and others and not (others == ["type"] and _branches_within(node[dominant], declared)):
            raise _not_enforced(json.dumps(others[0]) + f" beside {json.dumps(dominant)}", where,
                                f"move it into the schema that {json.dumps(dominant)} points to")
    if isinstance(node.get("pattern"), str):
        _check_regex(node["pattern"], f' in "pattern" at {where}')
    if isinstance(node.get("patternProperties"), dict):
        for name in node["patternProperties"]:
            _check_regex(name, f" in the patternProperties name {json.dumps(name)} at {where}")
    for key in ("enum", "const"):
        if key in node:
            _check_listed_values(node, key, where)
            return
    types = set(declared)
    implied = {"object"} if "properties" in node else {"array"} if "items" in node or "prefixItems" in node else set()
    implied.add(implied_kind)
    if "integer" in types:
        types.add("number")
    for kind, keywords in _TYPED.items():
        for key in keywords:
            if key in node and kind not in types | implied:
                raise _not_enforced(json.dumps(key), where, f'add "type": "{kind}" beside it')
    divisor = node.get("multipleOf")
    if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and (
            "number" in declared or (isinstance(divisor, float) and not divisor.is_integer())):
        raise _not_enforced(f'"multipleOf": {json.dumps(divisor)}', where,
                            'it is enforced on "type": "integer" with a whole divisor only')
    if "integer" in declared and "number" not in declared:
        _check_integer_bounds(node, where)
    if "number" in declared and not _holds_a_generated_number(node):
        raise ValueError(f"the number range at {where} holds no number of at most {NUMBER_DECIMALS} decimals, the "
                         "only ones the grammar engine (xgrammar) generates in a range: it would generate nothing "
                         "there and the output would not be valid JSON; widen the range")
    fmt = node.get("format") if isinstance(node.get("format"), str) else None
    if fmt in UNCHECKED_FORMATS and "string" in types | implied:
        raise _not_enforced(f'"format": {json.dumps(fmt)}', where,
                            "the formats checked are " + ", ".join(sorted(ENFORCED_FORMATS)))
    if fmt in UNCHECKED_FORMATS | ENFORCED_FORMATS and not (types | implied) - {""}:
        raise _not_enforced('"format"', where, 'add "type": "string" beside it')
    checked_string = [key for key in ("pattern", "format") if key in node
                      and (key == "pattern" or fmt in ENFORCED_FORMATS)]
    lengths = [key for key in ("minLength", "maxLength") if key in node]
    if checked_string and (lengths or len(checked_string) > 1):
        dropped = (lengths or checked_string[1:])[0]
        raise _not_enforced(f"{json.dumps(dropped)} beside {json.dumps(checked_string[0])}", where,
                            f"xgrammar applies only {json.dumps(checked_string[0])}: fold it into a pattern")
    properties = node.get("properties")
    if isinstance(properties, dict):
        missing = [name for name in node.get("required") or [] if isinstance(name, str) and name not in properties]
        if missing:
            raise _not_enforced(f"required key {json.dumps(missing[0])} without a schema in properties", where,
                                "add it to properties")
        for key in ("propertyNames", "patternProperties"):
            if key in node and properties:
                raise _not_enforced(f"{json.dumps(key)} beside properties", where,
                                    "xgrammar does not apply it to the properties listed: use one or the other")
    elif node.get("required"):
        raise _not_enforced('"required" without "properties"', where, "list the required keys in properties")


# The most decimals xgrammar 0.2 writes in a number between bounds (measured in
# tests/engine/test_structured_outputs.py: 1.000005 in (1, 1.00001), nothing in (1, 1.000001)).
NUMBER_DECIMALS = 6


def _numeric_bound(node: dict, key: str) -> int | float | None:
    """``node[key]`` where it is a finite number (a bound), else ``None``."""
    value = node.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _holds_a_generated_number(node: dict) -> bool:
    """Whether a number schema's bounds (``minimum``, ``exclusiveMinimum``, ``maximum``,
    ``exclusiveMaximum``) hold a number of at most ``NUMBER_DECIMALS`` decimals; True
    without both a lower and an upper bound."""
    def bound(key: str) -> Decimal | None:
        value = _numeric_bound(node, key)
        return None if value is None else Decimal(repr(value))

    lows = [(b, key == "exclusiveMinimum") for key in ("minimum", "exclusiveMinimum") if (b := bound(key)) is not None]
    highs = [(b, key == "exclusiveMaximum") for key in ("maximum", "exclusiveMaximum")
             if (b := bound(key)) is not None]
    if not lows or not highs:
        return True
    low, low_open = max(lows, key=lambda b: (b[0], b[1]))  # the tighter: at a tie the exclusive one
    high, high_open = min(highs, key=lambda b: (b[0], not b[1]))
    step = Decimal(1).scaleb(-NUMBER_DECIMALS)
    first = (low / step).to_integral_value(rounding=ROUND_CEILING) * step
    if low_open and first == low:
        first += step
    return first < high or (first == high and not high_open)


def _check_integer_bounds(node: dict, where: str) -> None:
    """An integer schema's bounds: xgrammar refuses a fractional one ("Integer constraint must
    be a whole number", no place named) and an empty range ("minimum greater than maximum").

    Raises:
        ValueError: naming the bound and its whole equivalent, or the empty range, at ``where``.
    """
    whole: dict[str, int] = {}  # the bound as an inclusive whole number
    for key, rounding, side in (("minimum", math.ceil, "minimum"), ("exclusiveMinimum", None, "minimum"),
                                ("maximum", math.floor, "maximum"), ("exclusiveMaximum", None, "maximum")):
        value = _numeric_bound(node, key)
        if value is None:
            continue
        if rounding is None:  # exclusive: the next whole number inwards
            bound = math.floor(value) + 1 if side == "minimum" else math.ceil(value) - 1
        else:
            bound = rounding(value)
        if value != int(value):
            raise ValueError(f"{json.dumps(key)}: {json.dumps(value)} on an integer at {where} is not a whole number, "
                             f"which the grammar engine (xgrammar) requires; write {json.dumps(side)}: {bound}")
        whole[side] = bound if side not in whole else (max if side == "minimum" else min)(whole[side], bound)
    if "minimum" in whole and "maximum" in whole and whole["minimum"] > whole["maximum"]:
        raise ValueError(f"the integer range at {where} holds no integer (from {whole['minimum']} to "
                         f"{whole['maximum']}); widen it")


def _names(value) -> set[str]:
    """A ``type`` keyword's names (a string or a list of them; anything else: none)."""
    return {t for t in (value if isinstance(value, list) else [value]) if isinstance(t, str)}


def _branches_within(branches, declared: set[str]) -> bool:
    """Whether ``declared`` (a type beside a combinator) adds nothing: every branch is a schema
    object whose own ``type`` lies within it."""
    return bool(declared) and isinstance(branches, list) and all(
        isinstance(b, dict) and "type" in b and _names(b["type"]) and _names(b["type"]) <= declared for b in branches)


# The keywords an enum / const may have beside it: checked against every listed value
# (jsonschema, without regular expressions or references); others beside it are refused.
_BESIDE_LISTED = frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                            "minLength", "maxLength", "format", "minItems", "maxItems", "minProperties",
                            "maxProperties", "required"})


def _check_listed_values(node: dict, key: str, where: str) -> None:
    """xgrammar generates any value an ``enum`` / ``const`` lists, whatever the keywords
    beside it; refuse a value they forbid, and keywords that cannot be checked cheaply (a
    ``pattern`` would run the client's regular expression here)."""
    beside = {k: v for k, v in node.items() if k in _ASSERTIONS and k not in ("enum", "const")}
    if not beside:
        return
    other = next((k for k in beside if k not in _BESIDE_LISTED), None)
    if other is not None:
        raise _not_enforced(f"{json.dumps(other)} beside {json.dumps(key)}", where,
                            f"xgrammar applies only {json.dumps(key)}: list only values it allows")
    import jsonschema
    validator_class = jsonschema.Draft202012Validator
    try:
        validator = validator_class(beside, format_checker=validator_class.FORMAT_CHECKER)
        values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
        bad = next((value for value in values if not validator.is_valid(value)), _NOTHING)
    except Exception as exc:  # noqa: BLE001 - jsonschema's errors for keywords it cannot apply
        raise ValueError(f"the keywords beside {json.dumps(key)} at {where} are not a valid schema: {exc}") from None
    if bad is not _NOTHING:
        raise _not_enforced(f"{key} value {json.dumps(bad)} failing its sibling keywords", where,
                            f"remove the value from {json.dumps(key)} (xgrammar would generate it)")


_NOTHING = object()


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    lines = [_XGRAMMAR_LOCATION.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line)[:500] or type(exc).__name__


class StructuredOutputManager:
    """Compiles constraints for one tokenizer, caches them, and hands out matchers.

    Not thread-safe: the engine's thread calls it; compiles run on its own worker thread.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary; the
            extra ids are never allowed).
        eos_token_id: the token that ends a sequence where the grammar may end.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = tokenizer
        self._compiler: xgr.GrammarCompiler | None = None  # made on a worker thread, once
        self._compiler_lock = threading.Lock()
        # one worker for the usual constraints, one for those over LARGE_CONSTRAINT_CHARS: each
        # lane compiles one at a time, in order
        self._executors = {large: ThreadPoolExecutor(1, thread_name_prefix="grammar-compile" + "-large" * large)
                           for large in (False, True)}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def grammar(self, params: StructuredOutputsParams) -> SequenceGrammar:
        """A matcher for sequence 0 of a request, its grammar compiled (or compiling).

        Raises:
            InvalidRequestError: for an invalid constraint (``grammar_of``).
        """
        key = params.key()
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            large = len(str(key[1])) > LARGE_CONSTRAINT_CHARS
            future = self._executors[large].submit(self._compile, grammar_of(params))
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return SequenceGrammar(future)

    def cancel_unwanted(self, wanted: Collection[Future]) -> int:
        """Drop the compiles not started yet that no request waits for any more (every request
        that asked for one went away while it queued), so that a client who sent a huge
        schema and left holds back no one after it. A compile already running runs on.

        Args:
            wanted: the compiles that requests still wait for (``SequenceGrammar.future``).

        Returns:
            How many compiles were dropped.
        """
        unwanted = [key for key, future in self._cache.items()
                    if not future.done() and future not in wanted and future.cancel()]
        for key in unwanted:
            del self._cache[key]
        return len(unwanted)

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        with self._compiler_lock:
            if self._compiler is None:  # about 0.3 s for a 49k vocabulary: once, off the step loop
                stop_token_ids = None if self.eos_token_id is None else [self.eos_token_id]
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=_NUM_THREADS, cache_enabled=False)
        return self._compiler.compile_grammar(grammar)  # (vLLM compiles on several threads with one compiler)

    def shutdown(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)


class SequenceGrammar:
    """One sequence's position in its grammar: an xgrammar matcher, made when the compile is
    done. Once the matcher has accepted a stop token (it terminated), the sequence's later
    tokens (after an EOS under ``ignore_eos``) are unconstrained."""

    __slots__ = ("_future", "matcher")

    def __init__(self, future: Future, matcher: xgr.GrammarMatcher | None = None) -> None:
        self._future = future
        self.matcher = matcher

    @property
    def future(self) -> Future:
        """The compile this grammar waits for (shared by every request of its constraint)."""
        return self._future

    def is_ready(self) -> bool:
        """Whether the compile has finished (successfully or not: see ``error``)."""
        if self.matcher is None and self._future.done() and self._future.exception() is None:
            self.matcher = xgr.GrammarMatcher(self._future.result())
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Why the compile failed, if it did."""
        if not self._future.done() or self._future.exception() is None:
            return None
        exc = self._future.exception()
        return f"structured_outputs: compiling the grammar failed: {type(exc).__name__}: {exc}"

    def wait(self, timeout: float) -> None:
        """Block until the compile finishes or ``timeout`` seconds pass."""
        try:
            self._future.exception(timeout=timeout)
        except TimeoutError:
            pass

    @property
    def is_active(self) -> bool:
        """The next token is constrained: the matcher exists and has not terminated."""
        return self.matcher is not None and not self.matcher.is_terminated()

    def fork(self) -> SequenceGrammar:
        """An independent copy at the same position (for a fork of a request with n > 1)."""
        return SequenceGrammar(self._future, None if self.matcher is None else self.matcher.fork())

    def allows_no_token(self) -> bool:
        """Whether the constraint allows no next token at all, not even a stop token: no text
        matches it from here (``root ::= root``, the regex ``[^\\s\\S]``), the request's
        fault. Fills one bitmask (microseconds); only called after a rejected token."""
        if not self.is_active:
            return False
        bitmask = xgr.allocate_token_bitmask(1, self._future.result().tokenizer_info.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        return not bool(bitmask.any())

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; ``False`` if the grammar forbids it (a bug: the mask
        allowed it). Tokens after termination are accepted unchecked."""
        return not self.is_active or self.matcher.accept_token(token_id)


@dataclass(slots=True)
class StepBitmask:
    """The token bitmasks of one step's constrained rows.

    Attributes:
        bitmask: ``[num_rows, ceil(vocab_size / 32)]`` int32 on the logits' device; bit
            ``j % 32`` of word ``j // 32`` of row ``i`` is set where token ``j`` is allowed
            (xgrammar's layout). Only the rows in ``indices`` are filled.
        indices: the constrained rows, ascending.
    """

    bitmask: torch.Tensor
    indices: list[int]


class GrammarBitmask:
    """Fills a step's bitmasks into one reused host buffer (pinned on CUDA) and moves it to
    the device.

    Args:
        vocab_size: the logits width.
        device: where the logits live.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._host = self._allocate(64)
        self._batch = xgr.BatchGrammarMatcher(max_threads=_NUM_THREADS)

    def _allocate(self, num_rows: int) -> torch.Tensor:
        shape = xgr.get_bitmask_shape(num_rows, self.vocab_size)
        return torch.empty(shape, dtype=xgr.bitmask_dtype, pin_memory=self.device.type == "cuda")

    def fill(self, rows: Sequence[SamplingRow]) -> StepBitmask | None:
        """The bitmasks of the rows whose grammar is active; ``None`` when there are none.

        Rows that share a matcher (the ``n`` samples of a prompt about to fork) are filled
        once and copied.
        """
        indices = [i for i, row in enumerate(rows) if row.grammar is not None and row.grammar.is_active]
        if not indices:
            return None
        if len(rows) > self._host.shape[0]:
            self._host = self._allocate(max(len(rows), 2 * self._host.shape[0]))
        first_row: dict[int, int] = {}  # id(matcher) -> the row that fills its mask
        copies = []
        for i in indices:
            source = first_row.setdefault(id(rows[i].grammar.matcher), i)
            if source != i:
                copies.append((source, i))
        filled = [i for i in indices if first_row[id(rows[i].grammar.matcher)] == i]
        self._batch.batch_fill_next_token_bitmask([rows[i].grammar.matcher for i in filled], self._host, filled)
        for source, i in copies:
            self._host[i] = self._host[source]
        bitmask = self._host[:len(rows)]
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=True)
        return StepBitmask(bitmask, indices)
