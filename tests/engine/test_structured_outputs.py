"""Structured outputs (xgrammar): every sample of a constrained request parses and validates,
greedy and sampled, mixed in one batch with unconstrained requests, with n > 1 and with
preemption; compiles run off the step loop; aborts leave nothing behind; bad constraints
are ``ValueError``s naming the field."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.structured_outputs import check_enforceable, grammar_of
from tests.engine.conftest import assert_idle

# A nested object, an enum, an integer range and an array with minItems (the issue's list);
# strings and arrays bounded so that a sample fits in MAX_TOKENS.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,6} \d{1,3}(\.\d)? (kg|lb)"
CHOICES = ["positive", "negative", "neutral"]
MAX_TOKENS = 160
NUM_SAMPLES = 50


def constrained(seed: int | None, max_tokens: int = MAX_TOKENS, **constraint) -> SamplingParams:
    """Greedy without a seed, temperature 1.0 with one."""
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


CONSTRAINTS = {"json": {"json": PERSON_SCHEMA}, "json_object": {"json_object": True},
               "regex": {"regex": REGEX}, "choice": {"choice": CHOICES}}
PROMPTS = {"json": "Describe a user of a web shop as JSON.",
           "json_object": "Describe a cat as a small JSON object with keys name and age.",
           "regex": "The weight of a parcel:", "choice": "The review 'I loved it' is"}


def chat(llm, text: str) -> dict:
    """``text`` as a user message through the chat template (token ids for ``generate``)."""
    return llm.llm_engine.chat_prompt([{"role": "user", "content": text}])


@pytest.mark.slow
def test_samples_of_every_kind_validate_in_one_batch_with_unconstrained_requests(llm):
    # 50 seeded samples at temperature 1.0 per kind, one greedy sample per kind, and two
    # unconstrained requests, all in one generate call (one continuous batch).
    kinds, prompts, params = [], [], []
    for kind, constraint in CONSTRAINTS.items():
        for seed in [*range(NUM_SAMPLES), None]:
            kinds.append(kind)
            prompts.append(chat(llm, PROMPTS[kind]))
            params.append(constrained(seed, **constraint))
    plain = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=1.0, seed=5, max_tokens=24)]
    outputs = llm.generate(prompts + ["The capital of France is"] * 2, params + plain, use_tqdm=False)
    num_cut = 0
    for kind, p, output in zip(kinds, params, outputs[:len(kinds)], strict=True):
        completion = output.outputs[0]
        if kind == "json_object" and completion.finish_reason == "length":
            # JSON mode bounds nothing: at temperature 1.0 this 135M model sometimes writes
            # an object without end. Cut by max_tokens, it is still a prefix the grammar
            # accepts token by token (OpenAI documents the same for its JSON mode).
            assert len(completion.token_ids) == MAX_TOKENS
            assert accepts_prefix(llm, p, completion.token_ids)
            num_cut += 1
            continue
        assert completion.finish_reason == "stop", (kind, completion.text)
        check(kind, completion.text)
    print(f"json_object: {num_cut} of {NUM_SAMPLES + 1} cut by max_tokens")
    # The unconstrained rows are untouched by their constrained neighbours.
    alone = llm.generate(["The capital of France is"] * 2, plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[-2:]] == [o.outputs[0].token_ids for o in alone]
    assert_idle(llm)


def accepts_prefix(llm, params: SamplingParams, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of ``params``' constraint accepts every token, in order."""
    grammar = llm.llm_engine._structured_outputs.grammar(params.structured_outputs)
    grammar.wait(60)
    assert grammar.is_ready() and grammar.error is None
    return all(grammar.matcher.accept_token(t) for t in token_ids)


@pytest.mark.slow
def test_greedy_constrained_output_is_the_same_alone_and_in_a_batch(llm):
    params = [constrained(None, **CONSTRAINTS[kind]) for kind in CONSTRAINTS]
    batch = llm.generate([PROMPTS[kind] for kind in CONSTRAINTS], params, use_tqdm=False)
    for kind, p, output in zip(CONSTRAINTS, params, batch, strict=True):
        check(kind, output.outputs[0].text)
        (solo,) = llm.generate(PROMPTS[kind], p, use_tqdm=False)
        assert solo.outputs[0].token_ids == output.outputs[0].token_ids


def test_n_forks_each_follow_their_own_grammar(llm):
    (output,) = llm.generate(PROMPTS["regex"], SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=40,
                                                              structured_outputs=StructuredOutputsParams(regex=REGEX)),
                             use_tqdm=False)
    texts = [c.text for c in output.outputs]
    for text in texts:
        check("regex", text)
    assert len(set(texts)) > 1, texts  # six independent matchers, not one shared


@pytest.mark.slow
def test_constrained_samples_are_unchanged_by_preemption(llm):
    digits = r"(\d ){12}"
    prompts = [list(range(200 + 30 * i, 240 + 30 * i)) for i in range(6)]
    params = [constrained(seed, max_tokens=40, regex=digits) for seed in [None, *range(5)]]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(dtype="float32", num_gpu_blocks=12)  # 6 x (40 + 12 to 24) tokens do not fit in 12 x 16
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats()["num_preemptions"] >= 1
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    for output in outputs:
        # (decoded alone: the detokenizer's first text depends on these arbitrary prompt ids)
        text = llm.get_tokenizer().decode(output.outputs[0].token_ids, skip_special_tokens=True)
        assert re.fullmatch(digits, text), text
    assert_idle(tight)


def test_a_compiling_grammar_holds_back_only_its_own_request(llm, monkeypatch):
    from engine.structured_outputs import StructuredOutputManager

    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def slow_compile(self, grammar):
        assert release.wait(60)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    engine = llm.llm_engine
    engine.add_request("slow", PROMPTS["regex"], constrained(None, regex=r"\d{4}"))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0.0, max_tokens=4))
    finished = {}
    while "plain" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "slow" not in finished and engine.stats()["num_waiting"] == 1
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch(r"\d{4}", finished["slow"].outputs[0].text)
    assert_idle(llm)


def test_aborts_while_compiling_and_while_decoding_leave_nothing(llm, monkeypatch):
    from engine.structured_outputs import StructuredOutputManager

    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile
    monkeypatch.setattr(StructuredOutputManager, "_compile",
                        lambda self, grammar: release.wait(60) and compile_grammar(self, grammar))
    engine = llm.llm_engine
    engine.add_request("compiling", "x", constrained(None, regex=r"[ab]{3}"))
    engine.add_request("decoding", PROMPTS["json"], SamplingParams(
        n=2, temperature=1.0, seed=1, max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json_object=True)))
    engine.step()
    engine.abort_request("compiling")
    release.set()
    for _ in range(3):
        engine.step()
    engine.abort_request("decoding")
    engine.step()
    assert not engine.has_unfinished_requests() and engine._compiling == []
    assert_idle(llm)


def _large_schema() -> dict:
    """A schema over LARGE_CONSTRAINT_CHARS of text (it compiles in about a second unpatched)."""
    from engine.structured_outputs import LARGE_CONSTRAINT_CHARS
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(20)]}
                                               for i in range(200)}}
    assert len(json.dumps(schema, sort_keys=True)) > LARGE_CONSTRAINT_CHARS
    return schema


def test_a_large_schemas_compile_holds_back_no_small_constraint_and_unwanted_ones_are_dropped(llm, monkeypatch):
    """A trial's 715 KB schema compiled for 119 s, its client long gone, and a new regex
    waited all that time behind it. Now the large ones compile on a worker of their own, and
    one whose every request went away before it started is dropped."""
    from engine.structured_outputs import StructuredOutputManager

    release = threading.Event()
    compile_grammar = StructuredOutputManager._compile
    started = []

    def compile_large_slowly(self, grammar):
        started.append(threading.current_thread().name)
        if len(str(grammar)) > 10_000:  # the large schemas' EBNF
            assert release.wait(60)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(StructuredOutputManager, "_compile", compile_large_slowly)
    engine = llm.llm_engine
    large = _large_schema()
    other_large = {**large, "required": ["p0"]}
    engine.add_request("large", "x", constrained(None, json=large))
    engine.add_request("large, gone", "x", constrained(None, json=other_large))  # queued behind "large"
    engine.add_request("small", PROMPTS["regex"], constrained(None, regex=r"[0-9]{4}"))  # (not cached yet)
    finished = {}
    deadline = time.monotonic() + 30
    while "small" not in finished and time.monotonic() < deadline:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "small" in finished, "the small regex waited behind the large schema's compile"
    assert re.fullmatch(r"[0-9]{4}", finished["small"].outputs[0].text)  # while "large" still compiles
    assert len(engine._compiling) == 2
    wanted = engine._compiling[1].grammar.future
    engine.abort_request("large, gone")
    engine.step()
    assert wanted.cancelled() and [r.request_id for r in engine._compiling] == ["large"]
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["large"].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(finished["large"].outputs[0].text), large)
    assert sorted(name.rsplit("_", 1)[0] for name in started) == ["grammar-compile", "grammar-compile-large"]
    # asked for again, the dropped constraint compiles anew
    engine.add_request("large again", "x", constrained(None, json=other_large))
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["large again"].outputs[0].finish_reason in ("stop", "length")
    assert_idle(llm)


@pytest.mark.parametrize("constraint, param", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= undefined_rule'}, "structured_outputs.grammar"),
])
def test_invalid_constraints_are_value_errors_naming_the_field(llm, constraint, param):
    with pytest.raises(ValueError, match=re.escape(param)) as info:
        llm.llm_engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert info.value.param == param
    assert_idle(llm)


@pytest.mark.parametrize("constraint, param, num_tokens", [
    ({"grammar": "root ::= root"}, "structured_outputs.grammar", 0),
    ({"regex": r"[^\s\S]"}, "structured_outputs.regex", 0),
    ({"json": {"type": "string", "pattern": r"[^\s\S]"}}, "structured_outputs.json", 1),  # the opening quote
])
def test_a_constraint_no_text_matches_fails_its_request_as_its_own_fault(llm, constraint, param, num_tokens):
    """It compiles, but allows no token (not even EOS) from the start or after a prefix: an
    InvalidRequestError naming the field (a 400 behind HTTP; it was a 500), and nothing left
    behind."""
    other = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match=re.escape(f"{param}: no text matches the constraint: it allows no "
                                                   f"token after the {num_tokens} generated")) as info:
        llm.generate(["x"], [SamplingParams(n=2, max_tokens=4, structured_outputs=StructuredOutputsParams(
            **constraint))])
    assert info.value.param == param
    assert_idle(llm)
    assert len(llm.generate(["x"], other)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("schema, message", [
    # xgrammar left these unconstrained (any value passed): refused instead
    ({"properties": {"x": {"$ref": "#foo"}}, "$defs": {"A": {"$anchor": "foo", "type": "integer"}}},
     '$ref "#foo" at #/properties/x: only references into the schema itself'),
    ({"$id": "https://example.com/s", "$defs": {"A": {"type": "integer"}},
      "properties": {"x": {"$ref": "https://example.com/s#/$defs/A"}}}, '$ref "https://example.com/s#/$defs/A" at'),
    ({"properties": {"x": {"$ref": ""}}}, '$ref "" at #/properties/x'),
    ({"properties": {"a/b~": {"type": "array", "prefixItems": [{"$dynamicRef": "#n"}]}}},
     "$dynamicRef at #/properties/a~1b~0/prefixItems/0 is not supported"),
])
def test_references_xgrammar_would_not_enforce_are_refused(schema, message):
    with pytest.raises(ValueError, match=re.escape("structured_outputs.json: " + message)) as info:
        grammar_of(StructuredOutputsParams(json={"type": "object", **schema}))
    assert info.value.param == "structured_outputs.json"


@pytest.mark.parametrize("schema, message", [
    # xgrammar compiled these: a grammar of nothing (an empty string, "finished") or of anything
    ({"anyOf": []}, "at #/anyOf: [] should be non-empty"),
    ({"oneOf": []}, "at #/oneOf: [] should be non-empty"),
    ({"allOf": []}, "at #/allOf: [] should be non-empty"),
    ({"type": "object", "required": ["a"], "properties": {"a/b": {"anyOf": []}}},
     "at #/properties/a~1b/anyOf: [] should be non-empty"),
    ({"type": []}, "at #/type: [] is not valid under any of the given schemas"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "integer", "minimum": "5"},
     "at #/minimum: '5' is not of type 'number'"),
    ({"$schema": "https://example.com/unknown", "type": "nonsense"}, "at #/type: 'nonsense' is not valid"),
])
def test_a_schema_its_metaschema_refuses_is_refused(schema, message):
    import xgrammar as xgr
    if schema.get("type") == []:
        xgr.Grammar.from_json_schema(json.dumps(schema))  # what was compiled before the check
    expected = "structured_outputs.json: not a valid JSON schema " + message
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        grammar_of(StructuredOutputsParams(json=schema))
    assert info.value.param == "structured_outputs.json"
    check_enforceable({"$schema": "https://example.com/unknown", "type": "integer"})  # an unknown draft: 2020-12's


@pytest.mark.parametrize("regex, text, message", [
    ("a$b", "ab", "'$' inside the match"),
    ("[\\^$]x", "\nx", "the class '[\\^$]' (xgrammar's regex reads '[\\^' as '[^'"),  # a second trial's
    ("[^]$a]", "\na]", "the class '[^]'"),
    ("\\Aab", "Aab", "the escape '\\A' (xgrammar matches the letter 'A' itself)"),
])
def test_a_regex_part_xgrammar_does_not_enforce_is_refused(regex, text, message):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    assert _is_grammar_accept_string(xgr.Grammar.from_regex(regex), text)  # what was generated before
    assert re.fullmatch(regex, text) is None
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.regex: {message}")) as info:
        grammar_of(StructuredOutputsParams(regex=regex))
    assert info.value.param == "structured_outputs.regex"


def test_the_escapes_xgrammar_takes_as_their_letter_are_those_listed():
    import string

    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from engine.structured_outputs import LITERAL_ESCAPE_LETTERS
    literal = []
    for letter in string.ascii_letters:
        try:
            grammar = xgr.Grammar.from_regex("\\" + letter)
        except RuntimeError:  # refused by xgrammar itself: a 400 already
            continue
        other = "r" if letter == "q" else "q"
        if _is_grammar_accept_string(grammar, letter) and not _is_grammar_accept_string(grammar, other):
            literal.append(letter)
    assert "".join(literal) == "".join(sorted(LITERAL_ESCAPE_LETTERS, key=string.ascii_letters.index))
    grammar_of(StructuredOutputsParams(regex="\\d\\w\\s\\D\\W\\S\\n\\t[\\d\\]]"))  # classes and escapes it knows


def test_a_regex_with_an_anchor_inside_the_match_is_refused():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    assert _is_grammar_accept_string(xgr.Grammar.from_regex("a$b"), "ab")  # what was generated before
    with pytest.raises(ValueError, match=re.escape("structured_outputs.regex: '$' inside the match is not enforced "
                                                   "by the grammar engine")) as info:
        grammar_of(StructuredOutputsParams(regex="a$b"))
    assert info.value.param == "structured_outputs.regex"
    grammar_of(StructuredOutputsParams(regex=r"^\d{3}-\d{4}$|^x$"))  # anchors at the ends are enforced


# A JSON string's unsafe characters (RFC 8259 section 7), each as the value "<c>" written raw
_RAW_UNSAFE = [chr(c) for c in range(0x20)] + ['"', "\\"]


def _string_grammar(pattern: str):
    import xgrammar as xgr
    return xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern}), any_whitespace=False)


@pytest.mark.parametrize("pattern, raw, part", [
    ('^a"b$', '"a"b"', "the character '\"'"),  # a trial's: {"p": "a"b"}, not JSON
    (r"^C:\\temp$", '"C:\\temp"', r"the character '\\\\'"),  # a JSON string whose \t is a tab
    ("^\\n$", '"\n"', r"the character '\\n'"),
    (r"^\x22$", '"""', r"the character '\\x22'"),
    (r"^\u0022$", '"""', r"the character '\\u0022'"),
    ("^a\tb$", '"a\tb"', r"the character '\t'"),  # a tab in the pattern itself
    (r"^[\x00-\x1f]$", '"\x01"', r"the class '[\\x00-\\x1f]'"),
    (r"^[\n\t]$", '"\n"', r"the class '[\\n\\t]'"),
    (r'^[\\"]$', '"\\"', r"""the class '[\\\\"]'"""),
    (r"^[\b]$", '"\x08"', r"the class '[\\b]'"),
    # a surrogate: no character; its bytes decode to three U+FFFD (a second trial's)
    (r"^\ud83d$", '"\ud83d"'.encode("utf-8", "surrogatepass"), r"the character '\\ud83d'"),
    (r"^[\ud800-\udfff]$", '"\udc00"'.encode("utf-8", "surrogatepass"), r"the class '[\\ud800-\\udfff]'"),
])
def test_a_pattern_xgrammar_writes_unescaped_into_a_json_string_is_refused(pattern, raw, part):
    from xgrammar.testing import _is_grammar_accept_string
    assert _is_grammar_accept_string(_string_grammar(pattern), raw)  # generated before: not JSON, or not a match
    with pytest.raises(ValueError, match=re.escape(f'{part} in "pattern" at # would be written into the JSON '
                                                   "string as it is, unescaped")):
        check_enforceable({"type": "string", "pattern": pattern})
    # an object's names are JSON strings too
    with pytest.raises(ValueError, match=re.escape(f"{part} in the patternProperties name")):
        check_enforceable({"type": "object", "patternProperties": {pattern: {"type": "integer"}}})
    grammar_of(StructuredOutputsParams(regex=pattern))  # plain text: no JSON string to break


@pytest.mark.parametrize("pattern", [
    "^[^a]$", "^.$", "^[ -~]$", "^[\\n ]$", '^["x]$', "^\\s$", "^\\W$", "^[\\x1f-!]$", "^\\x20$", "^\\/$",
    "^[\\w\"]$", "^[^\\x00-\\x1f]$", "^\\d{2}-[a-z]+$", "^[a\\ud800]$", "^[\\ud7ff-\\ue000]$",
])
def test_a_pattern_whose_unsafe_characters_xgrammar_leaves_out_is_compiled(pattern):
    from xgrammar.testing import _is_grammar_accept_string
    grammar = _string_grammar(pattern)
    assert [c for c in _RAW_UNSAFE if _is_grammar_accept_string(grammar, f'"{c}"')] == []
    check_enforceable({"type": "string", "pattern": pattern})


@pytest.mark.parametrize("bounds, generated", [
    ({"exclusiveMinimum": 0.5, "maximum": 0.5000001}, None),  # a trial's: {"x": } with finish_reason stop
    ({"exclusiveMinimum": 1, "exclusiveMaximum": 1.000001}, None),
    ({"minimum": 0.1234567, "maximum": 0.1234568}, None),
    ({"minimum": -0.5000001, "exclusiveMaximum": -0.5}, None),
    ({"minimum": 1e-7, "exclusiveMaximum": 1e-6}, None),
    ({"exclusiveMinimum": 1, "exclusiveMaximum": 1.00001}, "1.000005"),  # 6 decimals: xgrammar's most
    ({"minimum": 0.5, "maximum": 0.5000001}, "0.5"),
    ({"minimum": 1e-7, "maximum": 1e-6}, "0.000001"),
    ({"minimum": -1e308, "maximum": 1e308}, "12.5"),
])
def test_a_number_range_without_a_number_xgrammar_generates_is_refused(bounds, generated):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    schema = {"type": "number", **bounds}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, "") == (generated is None)  # an empty "number": not JSON
    if generated is not None:
        assert _is_grammar_accept_string(grammar, generated)
        check_enforceable({"type": "object", "properties": {"x": schema}})
        return
    with pytest.raises(ValueError, match=re.escape("the number range at #/properties/x holds no number of at most 6 "
                                                   "decimals")):
        check_enforceable({"type": "object", "properties": {"x": schema}})


@pytest.mark.parametrize("bounds, message", [
    ({"minimum": 1.5, "maximum": 2.5}, '"minimum": 1.5 on an integer at #/properties/x is not a whole number, which '
                                       'the grammar engine (xgrammar) requires; write "minimum": 2'),
    ({"exclusiveMaximum": -0.5}, '"exclusiveMaximum": -0.5 on an integer at #/properties/x is not a whole number, '
                                 'which the grammar engine (xgrammar) requires; write "maximum": -1'),
    ({"exclusiveMinimum": 1, "exclusiveMaximum": 2}, "the integer range at #/properties/x holds no integer (from 2 "
                                                     "to 1); widen it"),
    ({"minimum": 1, "maximum": 1}, None),
    ({"exclusiveMinimum": 0, "maximum": 1}, None),
    ({"minimum": 2.0, "maximum": 3}, None),
])
def test_an_integers_bounds_that_xgrammar_refuses_are_named(bounds, message):
    # xgrammar's own words named no place: "Integer constraint must be a whole number",
    # "Invalid range: minimum greater than maximum" for (1, 2) (a second trial's)
    import xgrammar as xgr
    schema = {"type": "object", "properties": {"x": {"type": "integer", **bounds}}}
    if message is None:
        xgr.Grammar.from_json_schema(json.dumps(schema))
        check_enforceable(schema)
        return
    with pytest.raises(RuntimeError):
        xgr.Grammar.from_json_schema(json.dumps(schema))
    with pytest.raises(ValueError, match=re.escape(message)):
        check_enforceable(schema)


def test_references_into_the_schema_and_ref_lookalikes_are_compiled():
    check_enforceable({"type": "object", "$defs": {"A": {"type": "integer"}}, "properties": {
        "a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#"}, "$ref": {"type": "string"},  # a property named $ref
        "c": {"const": {"$ref": "#anchor"}}, "d": {"enum": [{"$ref": ""}]}, "e": {"default": {"$dynamicRef": "#n"}}}})


_VALIDATOR = jsonschema.Draft202012Validator
# (schema, a value it forbids that xgrammar's grammar of it accepts, the refusal's words)
NOT_ENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], '"uniqueItems": true at #'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1], '"contains" at #'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, {"a": 1}, '"dependentRequired" at #'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}, '"dependentSchemas" at #'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"properties": {"a": {"const": 1}}},
      "then": {"required": ["b"]}}, {"a": 1}, '"if" at #'),
    ({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}, {"n": 3},
     '"not" at #/properties/n'),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 3, "allOf of 2 schemas at #"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, '"multipleOf": 0.5 at #'),
    ({"type": "number", "multipleOf": 2}, 3, '"multipleOf": 2 at #'),
    ({"type": "integer", "multipleOf": 2.5}, 3, '"multipleOf": 2.5 at #'),
    ({"type": "string", "format": "regex"}, "(", '"format": "regex" at #'),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "abc",
     '"maxLength" beside "$ref" at #'),
    ({"$defs": {"s": {"type": "integer"}}, "const": "a", "$ref": "#/$defs/s"}, 3, '"const" beside "$ref" at #'),
    ({"type": "integer", "minimum": 5, "anyOf": [{"type": "integer"}]}, 3, '"type" beside "anyOf" at #'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "oneOf": [{"required": ["b"]}, {"required": ["c"]}]}, {"a": 1}, '"type" beside "oneOf" at #'),
    ({"type": "object", "properties": {"a": {"enum": [1, 2, "x"], "type": "integer"}}}, {"a": "x"},
     'enum value "x" failing its sibling keywords at #/properties/a'),
    ({"const": "abc", "maxLength": 2}, "abc", 'const value "abc" failing its sibling keywords at #'),
    ({"type": "object", "properties": {"a": {"minimum": 5}}}, {"a": 3}, '"minimum" at #/properties/a'),
    ({"minLength": 3}, "ab", '"minLength" at #'),
    ({"required": ["a"]}, {}, '"required" at #'),
    # found by review: xgrammar applies a pattern or a checked format alone
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcdef", '"maxLength" beside "pattern" at #'),
    ({"type": "string", "format": "date-time", "maxLength": 5}, "2020-01-01T00:00:00Z",
     '"maxLength" beside "format" at #'),
    ({"type": "string", "format": "email", "pattern": "^z"}, "a@b.co", '"format" beside "pattern" at #'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, {"a": 1},
     'required key "b" without a schema in properties at #'),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "required": ["a"]}, {},
     '"required" without "properties" at #'),
    ({"type": "object", "properties": {"abc": {"type": "integer"}}, "propertyNames": {"maxLength": 2}}, {"abc": 1},
     '"propertyNames" beside properties at #'),
    ({"type": "object", "properties": {"xa": {"type": "integer"}}, "patternProperties": {"^x": {"type": "string"}}},
     {"xa": 1}, '"patternProperties" beside properties at #'),
    ({"format": "email"}, "x", '"format" at #'),
    ({"type": "string", "format": "email", "enum": ["notanemail"]}, "notanemail",
     'enum value "notanemail" failing its sibling keywords at #'),
    # a pattern beside an enum is not run here (it would run the client's regular expression)
    ({"type": "string", "pattern": "^z", "enum": ["a"]}, "a", '"pattern" beside "enum" at #'),
    # a trial's: a lookahead in a pattern is dropped; anchors are enforced only at the ends
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "^(?=b)a+$"}}, "required": ["p"]},
     {"p": "a"}, "the lookaround '(?=' in \"pattern\" at #/properties/p"),
    ({"type": "string", "pattern": "^(?!a)a+$"}, "a", "the lookaround '(?!' in \"pattern\" at #"),
    ({"type": "string", "pattern": "a$b"}, "ab", "'$' inside the match in \"pattern\" at #"),
    ({"type": "string", "pattern": "^a^b"}, "ab", "'^' inside the match in \"pattern\" at #"),
    ({"type": "string", "pattern": "(a|b$)c"}, "bc", "'$' inside the match in \"pattern\" at #"),
    ({"type": "string", "pattern": "(^a)+b"}, "aab", "a quantifier '+' on an anchor in \"pattern\" at #"),
    ({"type": "object", "propertyNames": {"pattern": "x(^a)"}}, {"xa": 1},
     "'^' inside the match in \"pattern\" at #/propertyNames"),
    ({"type": "object", "patternProperties": {"a$b": {"type": "integer"}}, "additionalProperties": False},
     {"ab": 1}, "'$' inside the match in the patternProperties name \"a$b\" at #"),
    # a second trial's: a class's "]" right after "[^", and an escape xgrammar takes as its letter
    ({"type": "string", "pattern": "^[^]a]$"}, "1a]", "the class '[^]' (Python reads its ']' as a character"),
    ({"type": "string", "pattern": "\\Aab$"}, "Aab", "the escape '\\A' (xgrammar matches the letter 'A' itself)"),
]


@pytest.mark.parametrize("schema, value, message", NOT_ENFORCED, ids=[m for _, _, m in NOT_ENFORCED])
def test_keywords_xgrammar_does_not_enforce_are_refused(schema, value, message):
    """Each refusal rests on a fact measured on xgrammar itself: its grammar of the schema
    accepts a value the schema forbids. If an upgrade of xgrammar enforces one, this fails
    and the refusal can go."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    assert not _VALIDATOR(schema, format_checker=_VALIDATOR.FORMAT_CHECKER).is_valid(value)
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(schema), json.dumps(value))
    with pytest.raises(ValueError, match=re.escape("structured_outputs.json: " + message)) as info:
        grammar_of(StructuredOutputsParams(json=schema))
    assert info.value.param == "structured_outputs.json"
    assert "is not enforced by the grammar engine" in str(info.value)


def test_draft_7_tuple_items_are_refused_with_their_2020_12_spelling():
    """xgrammar refuses an array "items" ("items must be a boolean or an object", which a
    sixth trial read as a refusal of draft 7); the 400 says how to write it."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    tuple_items = [{"type": "integer"}, {"type": "string"}]
    with pytest.raises(RuntimeError, match="items must be a boolean or an object"):
        xgr.Grammar.from_json_schema(json.dumps({"type": "array", "items": tuple_items}))
    with pytest.raises(ValueError, match=re.escape(
            'structured_outputs.json: "items" as an array (draft 7\'s tuple form) at #/properties/pair is not '
            'supported by the grammar engine (xgrammar); write the same as "prefixItems" (draft 2020-12)')):
        grammar_of(StructuredOutputsParams(json={"$schema": "http://json-schema.org/draft-07/schema#",
                                                 "type": "object", "properties": {"pair": {
                                                     "type": "array", "items": tuple_items}}}))
    grammar = grammar_of(StructuredOutputsParams(json={"type": "array", "prefixItems": tuple_items, "items": False}))
    assert _is_grammar_accept_string(grammar, '[1, "a"]') and not _is_grammar_accept_string(grammar, '["a", 1]')


# (schema, a value it forbids): xgrammar refuses the value, so the schema is compiled
ENFORCED = [
    # anchors at the ends of the match, of its alternatives, of groups that start or end it
    ({"type": "string", "pattern": "^a$|^b$"}, "ab"),
    ({"type": "string", "pattern": "((^a)|b)c$"}, "cc"),
    ({"type": "string", "pattern": "^[$^]a$"}, "a"),
    ({"type": "integer", "multipleOf": 5}, 7),
    ({"type": ["integer", "null"], "multipleOf": 5}, 7),
    ({"type": "string", "enum": ["a", "b"]}, "c"),  # pydantic's enum: the type adds nothing
    ({"type": ["string", "null"], "enum": ["a", None]}, "b"),
    ({"type": "object", "oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                  {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     {"c": 1}),  # a type every branch has adds nothing
    ({"type": "string", "format": "binary", "maxLength": 3}, "abcdef"),  # pydantic's bytes: an annotation
    ({"type": "integer", "multipleOf": 5.0}, 7),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, {"b": 1}),
    ({"type": "object", "propertyNames": {"maxLength": 1}}, {"bb": 1}),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),  # "properties" implies an object
    ({"items": {"type": "integer"}, "minItems": 2}, [1]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, {"a": 1, "b": 2}),
    ({"allOf": [{"type": "integer", "minimum": 5}]}, 3),
    ({"$defs": {"s": {"type": "string", "maxLength": 2}}, "$ref": "#/$defs/s", "description": "an annotation"},
     "abc"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "T"}, "x"),
    ({"type": "string", "format": "date"}, "nope"),
    ({"type": "integer", "format": "int32", "maximum": 9}, 10),  # a format on an integer is an annotation
]


@pytest.mark.parametrize("schema, value", ENFORCED, ids=[json.dumps(s)[:60] for s, _ in ENFORCED])
def test_keywords_xgrammar_enforces_are_compiled(schema, value):
    from xgrammar.testing import _is_grammar_accept_string
    assert not _VALIDATOR(schema, format_checker=_VALIDATOR.FORMAT_CHECKER).is_valid(value)
    grammar = grammar_of(StructuredOutputsParams(json=schema))
    assert not _is_grammar_accept_string(grammar, json.dumps(value))


def _valid_date(text: str) -> bool:
    import datetime
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return len(text) == 10


def _valid_ipv4(text: str) -> bool:
    import ipaddress
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


# (format, values its grammar must take, values it must refuse): a trial found xgrammar's own
# "date" taking "2022-02-30" (any day 01-31 in any month; so did "date-time"'s date) and its
# "ipv4" taking "012.034.056.078"; they are compiled as EXACT_FORMATS' patterns now.
FORMAT_CASES = [
    ("date", ["2022-12-31", "2022-04-30", "0001-01-01", "2000-02-29", "2024-02-29", "2400-02-29"],
     ["2022-02-30", "2021-04-31", "2022-11-31", "2023-02-29", "1900-02-29", "2100-02-29", "2022-13-01", "2022-1-01"]),
    ("date-time", ["2022-01-01T00:00:00Z", "2022-01-01t00:00:00.123+05:30", "2024-02-29T23:59:59-00:00",
                   "2016-12-31T23:59:60z"],
     ["2022-02-30T00:00:00Z", "2023-02-29T12:00:00Z", "2022-01-01T24:00:00Z", "2022-01-01T00:00:00+24:00",
      "2022-01-01T00:00:00"]),
    ("ipv4", ["0.0.0.0", "255.255.255.255", "10.0.0.1", "192.168.1.100", "1.20.199.249"],
     ["012.034.056.078", "00.00.0.0", "1.2.3.04", "256.1.1.1", "1.2.3"]),
]


@pytest.mark.parametrize("fmt, good, bad", FORMAT_CASES, ids=[case[0] for case in FORMAT_CASES])
def test_dates_and_ipv4_addresses_are_checked_in_full(fmt, good, bad):
    from xgrammar.testing import _is_grammar_accept_string
    oracle = {"date": _valid_date, "ipv4": _valid_ipv4}.get(fmt)  # Python's own reading, where it has one
    assert oracle is None or ([oracle(v) for v in good + bad] == [True] * len(good) + [False] * len(bad))
    schema = {"type": "object", "properties": {"v": {"type": ["string", "null"], "format": fmt}}, "required": ["v"]}
    grammar = grammar_of(StructuredOutputsParams(json=schema))
    assert [v for v in good if not _is_grammar_accept_string(grammar, json.dumps({"v": v}))] == []
    assert [v for v in bad if _is_grammar_accept_string(grammar, json.dumps({"v": v}))] == []
    assert _is_grammar_accept_string(grammar, '{"v": null}')


def test_a_format_inside_data_is_left_as_it_is():
    from xgrammar.testing import _is_grammar_accept_string
    value = {"format": "date", "at": "2022-02-30"}
    grammar = grammar_of(StructuredOutputsParams(json={"const": value}))
    assert _is_grammar_accept_string(grammar, json.dumps(value, separators=(",", ":")))  # xgrammar's const: compact


def _tag(schema: dict, **options) -> str:
    """A structural tag: free text, then "<f>" + a JSON value of ``schema`` + "</f>"."""
    return json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
        {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema, **options},
         "end": "</f>"}]}})


def test_a_structural_tags_schema_is_enforced():
    from xgrammar.testing import _is_grammar_accept_string
    grammar = grammar_of(StructuredOutputsParams(structural_tag=_tag(
        {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}, "required": ["n"]})))
    assert _is_grammar_accept_string(grammar, 'Calling <f>{"n": 3}</f>')
    assert not _is_grammar_accept_string(grammar, 'Calling <f>{"n": 7}</f>')
    grammar = grammar_of(StructuredOutputsParams(structural_tag=_tag({"type": "string", "format": "date"})))
    assert _is_grammar_accept_string(grammar, 'On <f>"2024-02-29"</f>')  # EXACT_FORMATS' pattern here too
    assert not _is_grammar_accept_string(grammar, 'On <f>"2022-02-30"</f>')


@pytest.mark.parametrize("tag, text, message", [
    (_tag({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}), '{"n": 3}',
     'the json_schema at #/format/tags/0/content: "not" at #/properties/n is not enforced'),
    (_tag({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, any_order=True),
     '{"n": 1, "n": 2}', '"any_order": true at #/format/tags/0/content is not enforced'),
    (_tag({"type": "object", "properties": {"s": {"type": "string", "maxLength": 2}}}, excludes=["x"]),
     '{"s": "abc"}', '"excludes" at #/format/tags/0/content is not enforced'),
])
def test_a_structural_tag_that_would_loosen_its_schema_is_refused(tag, text, message):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    # the fact behind each refusal: xgrammar's own grammar of the tag accepts what the schema forbids
    assert _is_grammar_accept_string(xgr.Grammar.from_structural_tag(tag), f"<f>{text}</f>")
    with pytest.raises(ValueError, match=re.escape("structured_outputs.structural_tag: " + message)) as info:
        grammar_of(StructuredOutputsParams(structural_tag=tag))
    assert info.value.param == "structured_outputs.structural_tag"


def test_a_pydantic_models_schema_is_compiled():
    """What clients send most: pydantic's schemas (Optional fields as anyOf with a default,
    enums through $ref with a description beside it, nested models, Literal, bounded lists)."""
    import enum
    from typing import Literal

    import pydantic

    class Color(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        zip: int | None = None

    class Order(pydantic.BaseModel):
        kind: Literal["order"]
        color: Color = pydantic.Field(description="the colour")
        address: Address
        items: list[str] = pydantic.Field(min_length=1, max_length=3)
        note: str | None = pydantic.Field(default=None, pattern="^[a-z ]*$")
        quantity: int = pydantic.Field(ge=1, le=9, multiple_of=1)

    schema = Order.model_json_schema()
    check_enforceable(schema)
    grammar_of(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("kwargs, param", [
    ({}, "structured_outputs"),
    ({"json": {}, "regex": "a"}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"regex": 3}, "structured_outputs.regex"),
])
def test_structured_outputs_params_need_exactly_one_constraint(kwargs, param):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == param
