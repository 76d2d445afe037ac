"""``SamplingParams``: how to pick each next token, with vLLM's field names and defaults."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's enum of the same name)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what this step added
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings (vLLM's ``SamplingParams`` names and defaults).

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: keep the smallest set of tokens whose probability sums to at least ``top_p``;
            in (0, 1], 1 disables it.
        top_k: keep the ``top_k`` most likely tokens; -1 or 0 disables it, and a value
            larger than the vocabulary is the same as off.
        seed: seeds this request's own random generator, so that its output depends only on
            its prompt, parameters and seed, whatever else shares the batch.
        max_tokens: most tokens to generate; ``None`` means up to ``max_model_len``.
        ignore_eos: keep generating after the end-of-sequence token.
        stop_token_ids: further token ids that end generation (kept in the output ids,
            like EOS).
        skip_special_tokens: leave special tokens out of the output text.
        output_kind: cumulative, delta or final-only outputs (``RequestOutputKind``).

    Raises:
        ValueError: naming the field and its allowed range, on construction.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1; got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63); got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0; got {self.stop_token_ids}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 are treated as greedy, as vLLM does."""
        return self.temperature < _GREEDY_EPS
