"""OpenAI HTTP API request and response models (the subset mini-infer serves), with vLLM's
sampling extras. Requests are validated here; their sampling fields become ``SamplingParams``."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError, excerpt
from engine.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams


class ErrorInfo(BaseModel):
    message: str = Field(description="What went wrong, naming the field and the limit.")
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(None, description="The request field at fault, if one is.")
    code: str | None = Field(None, description="A machine-readable code, e.g. "
                                "context_length_exceeded.")


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with token usage.")


class SamplingRequest(BaseModel):
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
    cache_salt: str | None = Field(None, description="Prefix caching: only requests with the same "
                                   "salt share cached KV blocks (vLLM's field); a non-empty string.")

    def engine_prompt(self) -> dict:
        """What ``EngineServer.generate`` takes as its prompt."""
        raise NotImplementedError

    def max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        """Top alternatives per token, ``None`` without logprobs."""
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters (deltas: the service streams or accumulates them).

        Raises:
            ValueError: naming the field and its allowed range.
        """
        max_tokens, logprobs = self.max_new_tokens(), self.num_logprobs()
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_logit_bias(self.logit_bias), output_kind=RequestOutputKind.DELTA,
            cache_salt=self.cache_salt)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(k): v for k, v in (bias or {}).items()}
    except ValueError:
        raise InvalidRequestError(f"logit_bias keys must be token ids (integers); got "
                                  f"{excerpt(list(bias))}", "logit_bias") from None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="The prompt: text or token ids (one prompt).")
    max_tokens: int | None = Field(16, description="Most tokens per choice.")
    logprobs: int | None = Field(None, description=f"Top alternatives per token, 0..{MAX_LOGPROBS}.")
    echo: bool = Field(False, description="Return the prompt's text before the completion.")

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt(self) -> dict:
        prompt = self.single_prompt()
        return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}

    def single_prompt(self) -> str | list[int]:
        """The prompt, unwrapped from a one-element list.

        Raises:
            InvalidRequestError: naming ``prompt``, for a batch of several prompts.
        """
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError(f"prompt: one prompt per request is supported; got "
                                          f"{len(prompt)}", "prompt")
            prompt = prompt[0]
        return prompt


class TextPart(BaseModel):
    """A content part; only text is served."""

    type: Literal["text"] = Field(description="Only 'text' parts are supported.")
    text: str = Field(description="The text.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Author.")
    content: str | list[TextPart] | None = Field(description="Text, or text parts.")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


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

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_prompt(self) -> dict:
        """The conversation with ``LLMEngine.chat_prompt``'s options."""
        return {"messages": [{"role": m.role, "content": m.text()} for m in self.messages],
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

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
