"""``SamplingParams``: how to pick each next token, with vLLM's field names and defaults."""
from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, field, fields

from engine.errors import InvalidRequestError, excerpt

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_N = 128  # OpenAI's limit on n (chat completions)
MAX_STOP_STRINGS = 16  # OpenAI allows 4; each costs the detokenizer a little per character


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's enum of the same name)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what this step added
    FINAL_ONLY = 2  # one output, when the request finishes


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} must be {allowed}; got {excerpt(value)}", param=name)


# The type of each field a caller sets by value (the others are checked below): an int field
# takes any integer (numpy's too, stored as int), a float field any real number (stored as
# float), a bool field only True or False; None where the field allows it. A float where an
# int belongs (logprobs=1.5) failed inside the step loop, and max_tokens=1.5 ran to 2 tokens.
_INT_FIELDS = {"n": False, "top_k": False, "seed": True, "max_tokens": True, "min_tokens": False,
               "logprobs": True, "prompt_logprobs": True}  # name -> None allowed
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")


def _check_types(params: SamplingParams) -> None:
    """Coerce numbers to their field's type, or raise naming the field."""
    for name, optional in _INT_FIELDS.items():
        value = getattr(params, name)
        if not (optional and value is None):
            _check(isinstance(value, numbers.Integral) and not isinstance(value, bool), name,
                   "an integer" + (" or None" if optional else ""), value)
            setattr(params, name, int(value))
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        _check(isinstance(value, numbers.Real) and not isinstance(value, bool), name, "a number", value)
        setattr(params, name, float(value))
    for name in _BOOL_FIELDS:
        _check(isinstance(getattr(params, name), bool), name, "a bool (True or False)", getattr(params, name))
    _check(params.stop is None or isinstance(params.stop, (str, list, tuple)), "stop",
           "a string or a list of strings", params.stop)
    _check(isinstance(params.stop_token_ids, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in params.stop_token_ids),
        "stop_token_ids", "a list of token ids", params.stop_token_ids)
    _check(isinstance(params.logit_bias, dict) and all(
        _is_token_id(k) and isinstance(v, numbers.Real) and not isinstance(v, bool)
        for k, v in params.logit_bias.items()), "logit_bias", "a map of token id to a number", params.logit_bias)
    _check(isinstance(params.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind",
           params.output_kind)


def _is_token_id(key) -> bool:
    """An integer, or a string of decimal digits (JSON's keys are strings)."""
    if isinstance(key, str):
        return key.isascii() and key.isdigit()
    return isinstance(key, numbers.Integral) and not isinstance(key, bool)


def _is_utf8_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of the
    constraint fields. The output is decoded through an xgrammar matcher
    (``engine.structured_outputs``), so every sequence matches the constraint unless it is
    cut short by ``max_tokens`` or a stop string.

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value that
            validates against it (no properties beyond those the schema lists).
        regex: the output matches this regular expression as a whole.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar in xgrammar's (GBNF-like) syntax with a rule ``root``.
        json_object: the output is one JSON object (OpenAI's JSON mode).
        structural_tag: an xgrammar structural tag, as JSON text (``{"type":
            "structural_tag", "format": {...}}``): text with tagged, schema-checked parts.
        disable_any_whitespace: JSON (``json``, ``json_object``) without whitespace between
            tokens of the syntax; by default any whitespace is allowed there.

    Raises:
        InvalidRequestError: (a ``ValueError``) on construction, naming the field, unless
            exactly one constraint is set and it has the right type. Whether a schema,
            regex or grammar is valid is checked when the request is added
            (``LLMEngine.add_request``).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs",
               f"exactly one of {', '.join(_CONSTRAINTS)}", given or None)
        kind = given[0]
        value = getattr(self, kind)
        types = {"json": (str, dict), "regex": str, "grammar": str, "structural_tag": str,
                 "json_object": bool, "choice": list}
        _check(isinstance(value, types[kind]), f"structured_outputs.{kind}",
               {"json": "a JSON schema (an object or its JSON text)", "json_object": "true",
                "choice": "a list of strings"}.get(kind, "a string"), value)
        if kind == "choice":
            _check(bool(value) and all(isinstance(c, str) for c in value), "structured_outputs.choice",
                   "a non-empty list of strings", value)

    @property
    def kind(self) -> str:
        """The constraint's field name: ``json``, ``regex``, ``choice``, ..."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar: equal keys, equal constraints."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if getattr(self, f.name) not in (None, False)]
        return f"StructuredOutputsParams({', '.join(shown)})"


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings (vLLM's ``SamplingParams`` names and defaults).

    Logits are processed in this order, per row of the batch: the ``structured_outputs``
    token mask sets every token the constraint forbids to -inf; ``logit_bias`` is added;
    ``min_tokens`` masks EOS and ``stop_token_ids``; ``repetition_penalty``, then
    ``presence_penalty`` and ``frequency_penalty``. ``logprobs`` are taken here (the
    log-softmax of these processed logits, before temperature and truncation, as vLLM
    reports them). Greedy rows take the argmax; sampled rows divide by ``temperature``, keep
    ``top_k``, ``top_p`` and ``min_p``, and draw from the rest.

    Attributes:
        n: sequences to generate from the prompt (its KV blocks are shared).
        temperature: softmax temperature, finite; below 1e-5 (0 included) means greedy.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``
            (Holtzman et al. 2019); in (0, 1], 1 disables it.
        top_k: keep the ``top_k`` most likely tokens; -1 or 0 disables it, and a value
            larger than the vocabulary is the same as off.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's;
            in [0, 1], 0 disables it.
        repetition_penalty: transformers' (Keskar et al. 2019): over prompt and output
            tokens, positive logits are divided by it and negative ones multiplied; in
            [0.01, 100], 1 disables it.
        presence_penalty: OpenAI's: subtracted once from each token already in the output;
            in [-2, 2].
        frequency_penalty: OpenAI's: subtracted per occurrence in the output; in [-2, 2].
        seed: seeds this request's own random draws, so that its output depends only on its
            prompt, parameters and seed, whatever else shares the batch; in [-2**63, 2**63),
            as vLLM's.
        stop: up to 16 strings that end generation; the text is cut before them.
        stop_token_ids: token ids that end generation (kept in the output ids).
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: most tokens to generate per sequence; ``None`` means up to
            ``max_model_len``.
        min_tokens: tokens to generate before EOS, a stop token id or a stop string may end
            it (vLLM V1's: a stop string is looked for only in later tokens).
        logprobs: return this many top alternatives (0 to 20) with each token's log
            probability; ``None`` returns none.
        prompt_logprobs: return, for each prompt token after the first, its log probability
            given the tokens before it and this many top alternatives (0 to 20), from the
            model's raw logits (no penalty, bias or constraint; vLLM's
            ``prompt_logprobs``); ``None`` returns none. Such a request does not read the
            prefix cache (as in vLLM: a cached block has no logits), and costs one LM-head
            row per prompt token.
        skip_special_tokens: leave special tokens out of the output text.
        logit_bias: token id -> bias added to its logit, in [-100, 100] (OpenAI's range).
        output_kind: cumulative, delta or final-only outputs (``RequestOutputKind``).
        structured_outputs: a constraint on the output (``StructuredOutputsParams``):
            greedy and sampled rows alike pick only tokens it allows, and EOS only where
            it may end (``min_tokens`` does not hold EOS back there: the constraint
            decides). With ``ignore_eos``, the tokens after an EOS the constraint allowed
            are unconstrained.
        cache_salt: enters the hash of the prompt's first KV block, so that with prefix
            caching only requests with the same salt share cached blocks (vLLM's name:
            tenants with different salts never read each other's K/V); a non-empty string of valid Unicode.

    Raises:
        InvalidRequestError: (a ``ValueError``) naming the field and its allowed range, on
            construction.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        _check(1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]", self.n)
        _check(0 <= self.temperature < math.inf, "temperature", "a finite number >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k",
               "-1 or 0 (off) or an integer >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(0.01 <= self.repetition_penalty <= 100, "repetition_penalty", "in [0.01, 100]",
               self.repetition_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        # vLLM's range (a signed 64-bit integer); request_generator hashes any of them
        _check(self.seed is None or -2**63 <= self.seed < 2**63, "seed", "in [-2**63, 2**63)", self.seed)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
               "min_tokens", f">= 0 and <= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"in [0, {MAX_LOGPROBS}]", self.logprobs)
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
               f"an integer in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "ids >= 0",
               self.stop_token_ids)
        _check(all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
               "a map of token id to a bias in [-100, 100]", self.logit_bias)
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
               "cache_salt", "a non-empty string", self.cache_salt)
        # hashed as UTF-8 in the step loop (block_manager.root_hash): a lone surrogate has none
        _check(self.cache_salt is None or _is_utf8_encodable(self.cache_salt), "cache_salt",
               "valid Unicode (a lone surrogate has no UTF-8 encoding)", self.cache_salt)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in self.stop),
               "stop", f"at most {MAX_STOP_STRINGS} non-empty strings", self.stop)
        # decoded text never holds a lone surrogate: such a stop string could never match
        _check(all(_is_utf8_encodable(s) for s in self.stop), "stop",
               "valid Unicode (a lone surrogate has no UTF-8 encoding)", self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "a StructuredOutputsParams", self.structured_outputs)

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 are treated as greedy, as vLLM does."""
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
