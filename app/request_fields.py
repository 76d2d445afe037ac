"""Every request field that OpenAI's or vLLM's API defines for ``/v1/completions`` and
``/v1/chat/completions``, and what this server does with it: the one list that says which
fields are honoured and which are refused.

- ``implemented``: the request models (``app.protocol``) declare the field and it does what
  the API says.
- ``no_effect``: accepted; by its definition it cannot change the output (OpenAI's end-user
  ids).
- ``unsupported``: a request that sets it to anything but a value that asks for nothing
  (``null``, or the API's default, in ``off``) gets a 400 naming it as ``param``, before any
  SSE byte. A client never gets something else than it asked for.

Fields that neither API defines are ignored, as OpenAI's and vLLM's servers do. Implementing
a field means declaring it on the request model and turning its status here to
``implemented``; ``tests/app/test_request_fields.py`` walks this list against the models and
the running service. Sources: OpenAI's API reference (chat/create, completions/create) and
vLLM's ``vllm/entrypoints/openai/protocol.py`` (its "extra parameters").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]
Status = Literal["implemented", "no_effect", "unsupported"]
ENDPOINTS: tuple[Endpoint, ...] = ("completions", "chat")
_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@dataclass(frozen=True)
class KnownField:
    """One request field of one endpoint.

    Attributes:
        name: the JSON key.
        endpoint: ``completions`` or ``chat``.
        status: ``implemented``, ``no_effect`` or ``unsupported``.
        example: a value that asks for something other than the default: an implemented
            field must change what the engine gets or how the reply is shaped; an unsupported
            one gets the 400 (the tests send it).
        requires: other fields the example needs to mean something (``stream`` for
            ``stream_options``).
        off: for an unsupported field, the values that ask for nothing and are accepted.
        note: what the field is for, or where its implementation is tracked.
        value_type: for a ``no_effect`` field, the JSON type the API gives it (``str``): any
            other value but ``null`` is a 400, as a request model's field would be.
    """

    name: str
    endpoint: Endpoint
    status: Status
    example: Any = None
    requires: dict = field(default_factory=dict)
    off: tuple = (None,)
    note: str = ""
    value_type: type | None = None

    def is_off(self, value: Any) -> bool:
        """Whether ``value`` asks for nothing (``True`` is not ``1`` here)."""
        return any(value is None if o is None else (type(value) is type(o) and value == o)
                   for o in self.off)


def _known(status: Status, name: str, example: Any, endpoints: tuple[Endpoint, ...] = ENDPOINTS,
           **kwargs) -> list[KnownField]:
    return [KnownField(name, endpoint, status, example, **kwargs) for endpoint in endpoints]


def _implemented(name: str, example: Any, endpoints: tuple[Endpoint, ...] = ENDPOINTS,
                 requires: dict | None = None) -> list[KnownField]:
    return _known("implemented", name, example, endpoints, requires=requires or {})


def _unsupported(name: str, example: Any, endpoints: tuple[Endpoint, ...] = ENDPOINTS,
                 off: tuple = (None,), note: str = "") -> list[KnownField]:
    return _known("unsupported", name, example, endpoints, off=off, note=note)


COMPLETIONS: tuple[Endpoint, ...] = ("completions",)
CHAT: tuple[Endpoint, ...] = ("chat",)
_GUIDED = {"guided_json": {"type": "object"}, "guided_regex": "[ab]", "guided_choice": ["a", "b"],
           "guided_grammar": 'root ::= "a"'}

KNOWN_FIELDS: list[KnownField] = [
    # ---- implemented: OpenAI's fields ----
    *_implemented("model", "another-model"),
    *_implemented("prompt", "Another prompt", COMPLETIONS),
    *_implemented("messages", [{"role": "user", "content": "Another question"}], CHAT),
    *_implemented("n", 2),
    *_implemented("temperature", 0.5),
    *_implemented("top_p", 0.5),
    *_implemented("stream", True),
    *_implemented("stream_options", {"include_usage": True}, requires={"stream": True}),
    *_implemented("stop", ["\n\n"]),
    *_implemented("seed", 7),
    *_implemented("presence_penalty", 0.5),
    *_implemented("frequency_penalty", 0.5),
    *_implemented("logit_bias", {"42": 5.0}),
    *_implemented("max_tokens", 5),
    *_implemented("max_completion_tokens", 5, CHAT),
    *_implemented("logprobs", 2, COMPLETIONS),
    *_implemented("logprobs", True, CHAT),
    *_implemented("top_logprobs", 2, CHAT, requires={"logprobs": True}),
    *_implemented("echo", True, COMPLETIONS),
    *_implemented("response_format", {"type": "json_object"}),
    *_implemented("tools", [_TOOL], CHAT),
    *_implemented("tool_choice", "required", CHAT, requires={"tools": [_TOOL]}),
    *_implemented("parallel_tool_calls", False, CHAT, requires={"tools": [_TOOL], "tool_choice": "required"}),
    *_unsupported("functions", [_TOOL["function"]], CHAT, off=(None, []),
                  note="deprecated: use tools"),
    *_unsupported("function_call", "auto", CHAT, off=(None, "none"), note="deprecated: use tool_choice"),
    *_known("no_effect", "user", "user-1234", note="an end-user id for abuse monitoring", value_type=str),
    *_known("no_effect", "safety_identifier", "user-1234", note="an end-user id for abuse monitoring",
            value_type=str),
    # ---- implemented: vLLM's extras ----
    *_implemented("top_k", 5),
    *_implemented("min_p", 0.1),
    *_implemented("repetition_penalty", 1.2),
    *_implemented("ignore_eos", True),
    *_implemented("min_tokens", 1),
    *_implemented("stop_token_ids", [42]),
    *_implemented("include_stop_str_in_output", True),
    *_implemented("skip_special_tokens", False),
    *_implemented("add_generation_prompt", False, CHAT),
    *_implemented("continue_final_message", True, CHAT, requires={"add_generation_prompt": False}),
    *_implemented("cache_salt", "tenant-a"),
    *_implemented("prompt_logprobs", 1),
    # ---- unsupported: OpenAI ----
    *_unsupported("best_of", 3, off=(None, 1), note="server-side best-of-n; vLLM V1 dropped it too"),
    *_unsupported("suffix", "!", COMPLETIONS, off=(None, ""), note="fill-in-the-middle"),
    *_unsupported("audio", {"voice": "alloy", "format": "wav"}, CHAT),
    *_unsupported("modalities", ["text", "audio"], CHAT, off=(None, ["text"])),
    *_unsupported("prediction", {"type": "content", "content": "x"}, CHAT,
                  note="predicted outputs"),
    *_unsupported("reasoning_effort", "high", CHAT),
    *_unsupported("verbosity", "low", CHAT),
    *_unsupported("web_search_options", {}, CHAT),
    *_unsupported("service_tier", "flex", CHAT, off=(None, "auto", "default")),
    *_unsupported("store", True, CHAT, off=(None, False)),
    *_unsupported("metadata", {"k": "v"}, CHAT, off=(None, {}), note="only used with store"),
    *_unsupported("prompt_cache_key", "k", CHAT),
    *_unsupported("prompt_cache_retention", "24h", CHAT),
    # ---- unsupported: vLLM's extras ----
    *_implemented("structured_outputs", {"choice": ["a", "b"]}),
    *[f for name, example in _GUIDED.items() for f in _implemented(name, example)],
    *_unsupported("guided_decoding_backend", "outlines", off=(None, "xgrammar", "auto"),
                  note="xgrammar is the one backend"),
    *_unsupported("guided_whitespace_pattern", " ", note="JSON whitespace: structured_outputs' "
                  "disable_any_whitespace"),
    *_unsupported("structural_tag", "{}", note="use structured_outputs.structural_tag"),
    *_unsupported("use_beam_search", True, off=(None, False)),
    *_unsupported("length_penalty", 0.5, off=(None, 1.0), note="beam search only"),
    *_unsupported("early_stopping", True, off=(None, False), note="beam search only"),
    *_unsupported("spaces_between_special_tokens", False, off=(None, True)),
    *_unsupported("truncate_prompt_tokens", 8),
    *_unsupported("allowed_token_ids", [1, 2]),
    *_unsupported("bad_words", ["x"], off=(None, [])),
    *_unsupported("logits_processors", ["x.y"], off=(None, [])),
    *_unsupported("return_tokens_as_token_ids", True, off=(None, False)),
    *_unsupported("return_token_ids", True, off=(None, False)),
    *_unsupported("priority", 1, off=(None, 0)),
    *_unsupported("request_id", "my-id"),
    *_unsupported("kv_transfer_params", {"k": "v"}),
    *_unsupported("vllm_xargs", {"k": 1}, off=(None, {})),
    *_unsupported("add_special_tokens", False, COMPLETIONS, off=(None, True)),
    *_unsupported("add_special_tokens", True, CHAT, off=(None, False)),
    *_unsupported("prompt_embeds", "AAAA", COMPLETIONS),
    *_unsupported("echo", True, CHAT, off=(None, False),
                  note="vLLM's chat echo: prefix the reply with the last message"),
    *_unsupported("documents", [{"title": "t", "text": "x"}], CHAT),
    *_unsupported("chat_template", "{{ messages }}", CHAT),
    *_unsupported("chat_template_kwargs", {"enable_thinking": True}, CHAT, off=(None, {})),
    *_unsupported("mm_processor_kwargs", {"k": 1}, CHAT, off=(None, {})),
    *_unsupported("media_io_kwargs", {"k": 1}, CHAT, off=(None, {})),
    *_unsupported("include_reasoning", False, CHAT, off=(None, True)),
]

_BY_ENDPOINT: dict[Endpoint, dict[str, KnownField]] = {
    endpoint: {f.name: f for f in KNOWN_FIELDS if f.endpoint == endpoint} for endpoint in ENDPOINTS}


def known_fields(endpoint: Endpoint, status: Status | None = None) -> list[KnownField]:
    """The fields of ``endpoint`` (with ``status``, if given), in list order."""
    return [f for f in _BY_ENDPOINT[endpoint].values() if status in (None, f.status)]


def unsupported_field(endpoint: Endpoint, body: dict[str, Any]) -> KnownField | None:
    """The first field of ``body`` (in list order) that is unsupported and not off."""
    for known in known_fields(endpoint, "unsupported"):
        if known.name in body and not known.is_off(body[known.name]):
            return known
    return None


def mistyped_field(endpoint: Endpoint, body: dict[str, Any]) -> KnownField | None:
    """The first ``no_effect`` field of ``body`` (in list order) whose value is neither
    ``null`` nor of its ``value_type``."""
    for known in known_fields(endpoint, "no_effect"):
        value = body.get(known.name)
        if value is not None and known.value_type is not None and not isinstance(value, known.value_type):
            return known
    return None
