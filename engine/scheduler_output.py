"""The contract between the scheduler and the model runner, one step at a time. No torch.

The scheduler fills a ``SchedulerOutput``; the runner reads it (never changing scheduler
state), runs one forward and returns a ``ModelRunnerOutput``, which the scheduler's
``update`` consumes. Everything here is plain data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # xgrammar only where a request is constrained
    from engine.structured_outputs import SequenceGrammar


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to draw one sequence's next token.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (read-only), for the repetition penalty.
        output_token_ids: the tokens generated so far (read-only; the same list the
            scheduler appends to), for penalties, ``min_tokens`` and seeded draws.
        seq_index: the sequence's index among its request's ``n`` (seeds depend on it).
        eos_token_id: masked while ``min_tokens`` is not reached, unless ``ignore_eos``.
        grammar: the sequence's matcher when ``params.structured_outputs`` is set (the
            sampler masks the tokens it forbids); advanced by the engine after each step.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    seq_index: int = 0
    eos_token_id: int | None = None
    grammar: SequenceGrammar | None = None


@dataclass(slots=True)
class ScheduledRequest:
    """One sequence's share of a step.

    Attributes:
        seq_id: the sequence (``Request.seq_id``).
        token_ids: the tokens to compute this step (a prompt chunk, or the last sampled token).
        num_computed_tokens: how many tokens already have K/V in the cache; the position of
            ``token_ids[0]``.
        block_table: physical block ids covering ``num_computed_tokens + len(token_ids)``
            tokens. Read-only for the runner.
        do_sample: this step reaches the sequence's last token, so its logits are sampled.
        num_samples: tokens to draw from those logits: ``n`` when the step finishes the
            prompt of a request about to fork, else 1 (0 without ``do_sample``). Sample ``j``
            is for sequence ``sampling_row.seq_index + j``.
        sampling_row: the sampler's inputs for this sequence.
    """

    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    do_sample: bool
    num_samples: int
    sampling_row: SamplingRow


@dataclass(slots=True)
class SchedulerOutput:
    """The scheduler's plan for one step.

    Attributes:
        scheduled: the sequences that run this step, in batch order.
        preempted_seq_ids: sequences preempted this step (their blocks are already free).
        blocks_to_copy: ``(src, dst)`` block pairs the runner copies before the forward
            (copy-on-write of shared blocks).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_seq_ids: list[str] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass(slots=True)
class SampledToken:
    """What the sampler picked for one sequence in one step.

    Attributes:
        token_id: the new token.
        logprob: its log probability, when the request asked for logprobs.
        rank: its rank (1 = most likely), when the request asked for logprobs.
        top_logprobs: the top ``logprobs`` alternatives as ``(token_id, logprob)``, most
            likely first.
    """

    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one forward produced.

    Attributes:
        sampled: seq id -> its ``num_samples`` new tokens, for every scheduled sequence
            with ``do_sample``.
        prompt_logprobs: seq id -> ``(index, tokens)`` for every scheduled prompt chunk of a
            request with ``prompt_logprobs``: ``tokens[j]`` is prompt token ``index + j``
            (``index >= 1``) with its log probability, rank and top alternatives given the
            tokens before it.
    """

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[SampledToken]]] = field(default_factory=dict)
