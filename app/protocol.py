"""OpenAI HTTP API request and response models (the subset mini-infer serves), with vLLM's
sampling extras. Requests are validated here; their sampling fields become ``SamplingParams``."""
from __future__ import annotations

import json
import math
import re
import time
import typing
import uuid
from typing import Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from app.tool_calls import ToolMode, tool_constraint
from engine.errors import InvalidRequestError, excerpt
from engine.json_schema import check_schema
from engine.sampling_params import MAX_LOGPROBS, MAX_N, RequestOutputKind, SamplingParams, StructuredOutputsParams

# OpenAI's API reference: "What sampling temperature to use, between 0 and 2."
OPENAI_MAX_TEMPERATURE = 2.0


class ErrorInfo(BaseModel):
    message: str = Field(description="What went wrong, naming the field and the limit.")
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(None, description="The request field at fault, if one is.")
    code: str | None = Field(None, description="A machine-readable code, e.g. "
                                "context_length_exceeded.")


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# Where tool i's schema sits in the calls' array of tool_choice required (app.tool_calls):
# an error about it names tools[i] and its schema's own pointers.
_CALL_SCHEMA_POINTER = re.compile(r"#/items/anyOf/(\d+)/properties/parameters")


class RequestModel(BaseModel):
    """A part of a request body, validated as OpenAI's API does rather than with pydantic's
    lax coercion: a value keeps its JSON type (``"10"`` is not an integer, ``1`` not a
    boolean, ``2.0`` not an integer; an integer is a number). ``null`` for a field whose type
    has no ``null`` means the field's default (OpenAI's reference marks ``temperature``,
    ``n``, ``stream``, ... nullable); a field whose type admits ``null`` keeps it
    (``max_tokens: null``: as many as fit).

    Raises:
        pydantic.ValidationError: a value of another JSON type (the service's 400, naming
            the field).
    """

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        if not isinstance(data, dict):
            return data
        defaulted = {field.alias or name for name, field in cls.model_fields.items()
                     if not field.is_required() and type(None) not in typing.get_args(field.annotation)}
        return {key: value for key, value in data.items() if value is not None or key not in defaulted}

    @field_validator("*")
    @classmethod
    def _strings_are_unicode(cls, value):
        return valid_unicode(value)


def valid_unicode(value):
    """``value``, if every string in it (object keys included) has a UTF-8 encoding: JSON's
    ``"\\ud800"`` escape decodes to a lone surrogate, which has none, so no tokenizer, hash
    or schema compiler could read it. Nested request models are not entered (each checks its
    own fields); the walk is iterative (the nesting depth is checked later).

    Raises:
        ValueError: where the first such string is.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = "" if item is value else " in a string it holds"
                raise ValueError(f"not valid Unicode ({exc.reason} at character {exc.start}{where})") from None
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


class StreamOptions(RequestModel):
    """OpenAI's ``stream_options`` and vLLM's ``continuous_usage_stats``; another key is a 400
    naming it, not ignored, and so is ``include_obfuscation: true``."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, description="Send a last chunk with token usage.")
    include_obfuscation: bool | None = Field(
        None, description="OpenAI's random padding of stream events against side channels: not served, so "
        "false (none) is accepted and true is a 400.")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: with include_usage, every chunk also carries the usage so far (a choice's "
        "chunk: that choice's completion tokens, its own included).")

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value):
        if value:
            raise ValueError("true is not supported: stream events are not padded (send false or leave it out)")
        return value


class JsonSchemaFormat(RequestModel):
    """OpenAI's ``response_format.json_schema``; another key (``schema_`` or a misspelt
    ``schema``) is a 400 naming it, not a schema silently left out."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$",
                      description="The schema's name (not used for decoding): letters, digits, _ and -, "
                      "at most 64, as OpenAI's.")
    description: str | None = Field(None, description="What the format is for (not used for decoding).")
    schema_: dict | None = Field(None, alias="schema", description="The JSON schema the output "
                                 "validates against; absent: any JSON object.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (JSON mode) or ``json_schema``.
    Another key, or ``json_schema`` with another type, is a 400 (OpenAI's too), not ignored.

    Raises:
        pydantic.ValidationError: ``json_schema`` given with type ``text`` or ``json_object``.
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"] = Field(description="The kind of output.")
    json_schema: JsonSchemaFormat | None = Field(None, description="For type json_schema only.")

    @field_validator("json_schema", mode="before")  # before its own fields are checked
    @classmethod
    def _only_for_its_type(cls, value, info):
        kind = info.data.get("type")  # None where type is missing or invalid: its own error is the one told
        if value is not None and kind != "json_schema":
            raise ValueError(f"only type json_schema takes a json_schema; type is {kind or 'not valid'}")
        return value


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` body field: exactly one constraint (``SamplingParams``'
    ``StructuredOutputsParams``)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="An EBNF grammar (xgrammar's syntax) with rule root.")
    json_object: bool | None = Field(None, description="Any JSON object.")
    structural_tag: str | None = Field(None, description="An xgrammar structural tag, as JSON text.")
    disable_any_whitespace: bool = Field(False, description="JSON without whitespace between tokens.")

    def constraint(self) -> dict:
        """``StructuredOutputsParams``' keyword arguments."""
        return {"json" if name == "json_" else name: value
                for name, value in self.model_dump(exclude_none=True).items()}


# vLLM's older body fields, each one constraint.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions. Fields not declared here land in
    ``model_extra``: ``app.request_fields`` says which of them the API defines (a 400 when
    set) and which no API defines (ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="The served model's name.")
    n: int = Field(1, description="Choices to generate.")
    temperature: float = Field(1.0, description="0 = greedy.")
    top_p: float = Field(1.0, description="Nucleus sampling mass, in (0, 1].")
    stream: bool = Field(False, description="Server-sent events instead of one JSON body.")
    stream_options: StreamOptions | None = Field(None, description="Streaming extras.")
    stop: str | list[str] | None = Field(None, description="Stop strings.")
    presence_penalty: float = Field(0.0, description="In [-2, 2].")
    frequency_penalty: float = Field(0.0, description="In [-2, 2].")
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias in [-100, 100].")
    seed: int | None = Field(None, description="Makes sampling repeatable.")
    # vLLM's extras
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 or 0 = off.")
    min_p: float = Field(0.0, description="Drop tokens below min_p x the top probability.")
    repetition_penalty: float = Field(1.0, description="transformers' repetition penalty, > 0.")
    ignore_eos: bool = Field(False, description="Keep generating after EOS.")
    min_tokens: int = Field(0, description="Tokens to generate before EOS may end it.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string in the text.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema.")
    structured_outputs: StructuredOutputsRequest | None = Field(None, description="vLLM's constraints.")
    guided_json: dict | str | None = Field(None, description="vLLM's older name of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="vLLM's older name of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="vLLM's older name of structured_outputs.grammar.")
    # The request field each constraint came from, for errors (engine name -> client name).
    _constraint_param: str | None = PrivateAttr(None)
    cache_salt: str | None = Field(None, description="Prefix caching: only requests with the same "
                                   "salt share cached KV blocks (vLLM's field); a non-empty string.")
    prompt_logprobs: int | None = Field(None, description=f"vLLM's: each prompt token's log probability and "
                                        f"this many top alternatives, 0..{MAX_LOGPROBS}; not with stream.")

    def engine_prompts(self) -> list[dict]:
        """What ``EngineServer.generate`` takes as its prompt, one per prompt (a chat request
        has one; a completions request may send a batch)."""
        raise NotImplementedError

    def max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        """Top alternatives per token, ``None`` without logprobs."""
        raise NotImplementedError

    def engine_prompt_logprobs(self) -> int | None:
        """The engine's ``prompt_logprobs``: top alternatives per prompt token, ``None`` for
        none. As vLLM, not with ``stream`` (which would hold the first chunk back for them).

        Raises:
            InvalidRequestError: naming ``prompt_logprobs``, set with ``stream``.
        """
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs is not available with stream: true (as vLLM's); "
                                      "send the request without stream", "prompt_logprobs")
        return self.prompt_logprobs

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters (deltas: the service streams or accumulates them).

        Raises:
            InvalidRequestError: naming the field and its allowed range (a ValueError), or
                ``ignore_eos`` / ``min_tokens`` beside a constraint (the engine would let the
                output run on unconstrained past the constraint's end, or end it before
                ``min_tokens``).
        """
        if OPENAI_MAX_TEMPERATURE < self.temperature < math.inf:  # the engine, as vLLM's, takes any finite
            raise InvalidRequestError(f"temperature must be at most {OPENAI_MAX_TEMPERATURE:g} (the OpenAI API's "
                                      f"range [0, 2]); got {self.temperature:g}", param="temperature")
        if self.stream_options is not None and not self.stream:  # as vLLM: not ignored silently
            raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:  # vLLM ignores it then; refused here
            raise InvalidRequestError("stream_options.continuous_usage_stats needs stream_options.include_usage: "
                                      "true", param="stream_options.continuous_usage_stats")
        max_tokens, logprobs = self.max_new_tokens(), self.num_logprobs()
        structured_outputs = self.structured_outputs_params()
        for field, value in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens)):
            if structured_outputs is not None and value:  # the engine's rule would drop one or the other
                raise InvalidRequestError(
                    f"{field} cannot be combined with {self._constraint_field()}: a constraint on the "
                    f"output decides where it ends (at its end only EOS is allowed); got {json.dumps(value)}", field)
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_logit_bias(self.logit_bias), output_kind=RequestOutputKind.DELTA,
            cache_salt=self.cache_salt, structured_outputs=structured_outputs,
            prompt_logprobs=self.engine_prompt_logprobs())

    def constraints(self) -> list[tuple[str, dict]]:
        """``(request field, StructuredOutputsParams kwargs)`` for every constraint set."""
        found = []
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None:
                raise InvalidRequestError("response_format: type json_schema needs json_schema "
                                          "({name, schema})", "response_format.json_schema")
            schema = response_format.json_schema.schema_
            found.append(("response_format.json_schema.schema",
                          {"json_object": True} if schema is None else {"json": schema}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.constraint()))
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                found.append((name, {kind: getattr(self, name)}))
        return found

    def _constraint_field(self) -> str:
        """The request field the constraint came from, as the client wrote it: ``tool_choice``
        for a call forced by the tools (whose ``param`` names the tool's schema)."""
        source = self._constraint_param.split(".")[0]
        return "tool_choice" if source.startswith("tools") else source

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint of the request, ``None`` without one.

        Raises:
            InvalidRequestError: naming the request field, for two constraints at once or a
                malformed one.
        """
        found = self.constraints()
        if not found:
            return None
        if len(found) > 1:
            names = [name.split(".")[0] for name, _ in found]
            raise InvalidRequestError(f"{names[1]}: only one of {', '.join(names)} may be set "
                                      "(each constrains the whole output)", names[1])
        self._constraint_param, kwargs = found[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except InvalidRequestError as exc:
            raise InvalidRequestError(*self.client_param(str(exc), exc.param)) from None

    def client_param(self, message: str, param: str | None, prompt_index: int = 0) -> tuple[str, str | None]:
        """An error's ``(message, param)`` (about the prompt at ``prompt_index``) with the
        engine's ``structured_outputs[.field]`` renamed to the request field the constraint
        came from (``guided_json``, ``response_format.json_schema.schema``, ...)."""
        source = self._constraint_param
        if param is None or not param.startswith("structured_outputs") or source in (None, "structured_outputs"):
            return message, param
        message = source + message[len(param):] if message.startswith(param) else message
        if source == "tools":  # required: the calls' array; name the tool whose schema failed
            tool = _CALL_SCHEMA_POINTER.search(message)
            if tool is not None:
                where = f"tools[{tool.group(1)}].function.parameters"
                return where + _CALL_SCHEMA_POINTER.sub("#", message.removeprefix(source)), where
        return message, source

    def check_nesting(self) -> None:
        """Checks that no field nests objects and arrays deeper than ``MAX_JSON_DEPTH``.

        Raises:
            InvalidRequestError: naming the top-level field that does.
        """
        fields = [(name, getattr(self, name)) for name in type(self).model_fields]
        for name, value in fields + list((self.model_extra or {}).items()):
            field = type(self).model_fields.get(name)
            depth = json_depth(value, MAX_JSON_DEPTH)
            if depth > MAX_JSON_DEPTH:
                param = field.alias or name if field is not None else name
                raise InvalidRequestError(f"{param}: nests objects and arrays more than {MAX_JSON_DEPTH} "
                                          "levels deep", param)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """``stream_options.continuous_usage_stats`` (with ``include_usage``, as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


# Levels of objects and arrays one request field may nest: far more than a real JSON schema or
# conversation takes. Deeper ones failed as 500s: jsonschema's schema check ran out of Python's
# recursion at ~200 levels (a tool's parameters) and Ray's pickling on the way to the engine at
# ~500 (a structured_outputs schema).
MAX_JSON_DEPTH = 128


def json_depth(value, limit: int) -> int:
    """Levels of dicts, lists and request models in ``value`` (0 for a scalar), counted
    without recursion and up to ``limit + 1`` at most."""
    deepest, stack = 0, [(value, 0)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        if isinstance(item, BaseModel):
            item = dict(item)
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


# Digits of a logit_bias key: a token id fits in 2**31 (any vocabulary), and a longer key would
# reach Python's limit on int() of a long string (4,300 digits) with an error naming no field.
MAX_TOKEN_ID_DIGITS = 10


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's token-id keys (decimal digits without leading zeros; not Python's int()
    syntax, which allows spaces, underscores and leading zeros, so that "42" and "0042" would
    be one token whose bias the later key silently replaced) as ints."""
    pattern = r"0|-?[1-9][0-9]{0,%d}" % (MAX_TOKEN_ID_DIGITS - 1)
    bad = [k for k in bias or {} if not re.fullmatch(pattern, k)]
    if bad:
        raise InvalidRequestError(f"logit_bias keys must be token ids (integers of at most "
                                  f"{MAX_TOKEN_ID_DIGITS} digits, without leading zeros); got "
                                  f"{excerpt(bad[0])}", "logit_bias")
    return {int(k): v for k, v in (bias or {}).items()}


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="The prompt: text or token ids, or a list of prompts (a batch: each "
                    "prompt's n choices, prompt after prompt).")
    max_tokens: int | None = Field(16, description="Most tokens per choice; 0 only with echo (the prompt alone).")
    logprobs: int | None = Field(None, description=f"Top alternatives per token, 0..{MAX_LOGPROBS}; with "
                                 "echo, the prompt's tokens' too.")
    echo: bool = Field(False, description="Return the prompt's text (and with logprobs, its tokens' "
                       "logprobs) before the completion.")

    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the reply is the prompt alone, as vLLM's (which
        generates one token and leaves it out): a prompt's log probabilities in one request."""
        return self.echo and self.max_tokens == 0

    def max_new_tokens(self) -> int | None:
        """Raises: InvalidRequestError naming ``min_tokens`` above an echoed ``max_tokens`` of 0."""
        if self.echo_only():
            if self.min_tokens:
                raise InvalidRequestError(f"min_tokens must be 0 with max_tokens 0 (echo); got "
                                          f"{excerpt(self.min_tokens)}", "min_tokens")
            return 1
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        """As ``SamplingRequest.engine_prompt_logprobs``; with ``echo`` and ``logprobs``, at
        least ``logprobs`` (the echoed prompt's tokens get theirs, as vLLM's), streamed too."""
        asked = super().engine_prompt_logprobs()
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, asked or 0)
        return asked

    def is_batch(self) -> bool:
        """Whether ``prompt`` is a list of prompts (of one or more), not one prompt."""
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], (str, list))

    def client_param(self, message: str, param: str | None, prompt_index: int = 0) -> tuple[str, str | None]:
        """As ``SamplingRequest.client_param``; where ``prompt`` is a list of prompts, the
        engine's ``prompt`` (or ``prompt[i]``, a token id of the prompt it was given) becomes
        ``prompt[prompt_index]`` (``prompt[prompt_index][i]``)."""
        if param is not None and (param == "prompt" or param.startswith("prompt[")) and self.is_batch():
            named = f"prompt[{prompt_index}]" + param[len("prompt"):]
            return named + message[len(param):] if message.startswith(param) else message, named
        return super().client_param(message, param, prompt_index)

    def engine_prompts(self) -> list[dict]:
        """What ``EngineServer.generate`` takes, one per prompt (a batch's in order).

        Raises:
            InvalidRequestError: naming ``prompt``, for a batch whose choices (prompts x
                ``n``) exceed ``MAX_N``.
        """
        prompts = self.prompt if self.is_batch() else [self.prompt]
        if len(prompts) * self.n > MAX_N:
            raise InvalidRequestError(f"prompt: a batch of {len(prompts)} prompts x n ({self.n}) is "
                                      f"{len(prompts) * self.n} choices; at most {MAX_N}", "prompt")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]


class TextPart(RequestModel):
    """A content part; only text is served. Another key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="Only 'text' parts are supported.")
    text: str = Field(description="The text.")


class FunctionCall(RequestModel):
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments, as JSON text.")


class ToolCall(RequestModel):
    """A call an assistant message made (OpenAI's ``message.tool_calls[i]``)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(description="The call's id; a tool message answers it by tool_call_id.")
    type: Literal["function"] = Field("function", description="Only functions.")
    function: FunctionCall = Field(description="The function and its arguments.")


class ChatMessage(RequestModel):
    """One message of ``messages``. Keys OpenAI's client hands back in an assistant message
    it received (``refusal``, ``annotations``, ``audio``, ...) are ignored.

    Raises:
        pydantic.ValidationError: ``content`` missing or null in a message other than an
            assistant's (OpenAI's rule; a misspelt ``contents`` is caught by it), an empty
            array of parts, a tool message without ``tool_call_id``, or ``tool_calls`` in a
            message other than an assistant's (the chat template would write them into the
            prompt as calls that message made).
    """

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Author.")
    content: str | typing.Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        None, validate_default=True, description="Text, or text parts (at least one); only an assistant's "
        "may be left out.")
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: str | None = Field(None, validate_default=True, description="A tool message (where it "
                                     "is required): the call it answers.")
    name: str | None = Field(None, description="The participant's name; the chat template "
                             "gets it as the message's name (SmolLM2's does not print it).")

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value, info):
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or text parts); only an "
                             "assistant's may be null or left out")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_of_an_assistant(cls, value, info):
        role = info.data.get("role")
        if value is not None and role is not None and role != "assistant":
            raise ValueError(f"only an assistant message has tool_calls (the calls it made); this is a "
                             f"{role} message")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_of_a_tool_message(cls, value, info):
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def engine_message(self) -> dict:
        """The message as ``LLMEngine.chat_prompt`` takes it."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(RequestModel):
    """A tool's function; another key (a misspelt ``parameters``) is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="The function's name.")
    description: str | None = Field(None, description="What it does, for the model.")
    parameters: dict | None = Field(None, description="A JSON schema of its arguments (an object).")
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema.")


class ChatTool(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = Field(description="Only functions.")
    function: FunctionDefinition = Field(description="The function.")


class NamedFunction(RequestModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The function to call.")


class NamedToolChoice(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = Field(description="Only functions.")
    function: NamedFunction = Field(description="The function the reply must call.")


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: int | None = Field(None, description="Most tokens per choice (deprecated name).")
    max_completion_tokens: int | None = Field(None, description="Most tokens per choice.")
    logprobs: bool = Field(False, description="Return the sampled tokens' log probabilities.")
    top_logprobs: int | None = Field(None, description=f"Alternatives per token, 0..{MAX_LOGPROBS}.")
    add_generation_prompt: bool = Field(True, description="vLLM's: end the prompt with the "
                                        "chat template's opening of an assistant message.")
    continue_final_message: bool = Field(False, description="vLLM's: leave the last message "
                                         "open (no end-of-turn token) for the model to continue; "
                                         "needs add_generation_prompt false.")
    tools: list[ChatTool] | None = Field(None, min_length=1, description="Functions the model may call "
                                         "(at least one, as OpenAI's: leave it out for none).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function.")
    parallel_tool_calls: bool = Field(True, description="More than one call may be made (required, auto).")

    def tool_mode(self) -> ToolMode | None:
        """How the reply holds tool calls; ``None`` without tools or with ``none``.

        Raises:
            InvalidRequestError: naming ``tool_choice``, for a choice other than ``none``
                without ``tools`` (as vLLM's; OpenAI refuses ``none`` too; an empty ``tools``
                is refused by validation), or a function not among them.
        """
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            what = excerpt(choice) if isinstance(choice, str) else f"function {excerpt(choice.function.name)}"
            raise InvalidRequestError(f"tool_choice: {what} needs tools, which this request does not give",
                                      "tool_choice")
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools]
            if choice.function.name not in names:
                raise InvalidRequestError(f"tool_choice: function {excerpt(choice.function.name)} is not "
                                          f"among tools ({', '.join(names)})", "tool_choice")
            return ToolMode("named", choice.function.name)
        return ToolMode(choice, parallel=self.parallel_tool_calls)

    def check_tools(self) -> None:
        """Checks what ``tool_mode`` does not: every function name once, and every
        ``parameters`` a JSON schema (its metaschema's check, ``jsonschema``) of an object
        (OpenAI's rule: a call's arguments are a JSON object), whether or not this request's
        choice makes the model call that function.

        Raises:
            InvalidRequestError: naming ``tools[i].function.name`` or ``...parameters``.
        """
        first_index: dict[str, int] = {}
        for i, tool in enumerate(self.tools or []):
            name, schema = tool.function.name, tool.function.parameters
            if name in first_index:
                raise InvalidRequestError(f"tools[{i}].function.name: {name!r} is also tools[{first_index[name]}]'s; "
                                          "function names must be unique", f"tools[{i}].function.name")
            first_index[name] = i
            try:
                if schema is not None:
                    check_schema(schema)
            except jsonschema.SchemaError as exc:
                where = "".join(f"[{part!r}]" for part in exc.path)
                raise InvalidRequestError(f"tools[{i}].function.parameters is not a valid JSON schema: "
                                          f"{exc.message} (at parameters{where})",
                                          f"tools[{i}].function.parameters") from exc
            if schema is not None and schema.get("type", "object") != "object":
                raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema of type object "
                                          f"(a call's arguments are an object); got type {excerpt(schema['type'])}",
                                          f"tools[{i}].function.parameters")

    def functions(self) -> list[dict]:
        return [tool.function.model_dump(exclude_none=True) for tool in self.tools or []]

    def constraints(self) -> list[tuple[str, dict]]:
        mode = self.tool_mode()
        constraint = None if mode is None else tool_constraint(self.functions(), mode, self.parallel_tool_calls)
        if constraint is None:
            return super().constraints()
        param = "tools" if mode.kind == "required" else f"tools[{self._tool_index(mode.name)}].function.parameters"
        return [(param, constraint), *super().constraints()]

    def _tool_index(self, name: str) -> int:
        return next(i for i, tool in enumerate(self.tools) if tool.function.name == name)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self) -> SamplingParams:
        """As ``SamplingRequest.sampling_params``; an error about the token limit names
        ``max_completion_tokens`` where the request set that, not ``max_tokens``."""
        try:
            return super().sampling_params()
        except InvalidRequestError as exc:
            if self.max_completion_tokens is None or exc.param not in ("max_tokens", "min_tokens"):
                raise
            raise InvalidRequestError(self._as_sent(str(exc)), self._as_sent(exc.param)) from None

    def client_param(self, message: str, param: str | None, prompt_index: int = 0) -> tuple[str, str | None]:
        """As ``SamplingRequest.client_param``; the engine's length errors name
        ``max_tokens``, which reads ``max_completion_tokens`` where the request set that."""
        message, param = super().client_param(message, param, prompt_index)
        return self._as_sent(message), param

    def _as_sent(self, text: str) -> str:
        """``text`` naming ``max_completion_tokens`` instead of ``max_tokens`` where the request
        set that field (the engine knows only ``max_tokens``)."""
        if self.max_completion_tokens is None:
            return text
        return text.replace("max_tokens", "max_completion_tokens")

    def engine_prompts(self) -> list[dict]:
        """The conversation with ``LLMEngine.chat_prompt``'s options (one prompt)."""
        return [{"messages": [m.engine_message() for m in self.messages],
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "tools": self.functions() if self.tool_mode() is not None else None}]

    def num_logprobs(self) -> int | None:
        """``top_logprobs`` as the engine's ``logprobs``, ``None`` when not asked for.

        Raises:
            InvalidRequestError: naming ``top_logprobs``, out of range or without ``logprobs``.
        """
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]; got "
                                      f"{excerpt(self.top_logprobs)}", "top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs to be true", "top_logprobs")
            return None
        return self.top_logprobs or 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache.")


class UsageInfo(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    prompt_tokens_details: PromptTokensDetails = Field(description="Of the prompt tokens, the cached ones.")
    completion_tokens: int = Field(description="Tokens generated, all choices.")
    total_tokens: int = Field(description="Their sum.")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
