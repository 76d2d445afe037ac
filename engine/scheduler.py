"""Continuous-batching scheduler: admission by free blocks, token budget, preemption. No torch.

Each step, in order:

1. Every running request gets its next tokens (one for a decode, a chunk for a prompt still
   being prefilled), in admission order. A request whose next token crosses into a new block
   takes one from the pool; when the pool is empty, the most recently admitted running
   request is preempted (its blocks freed, back to the front of the waiting queue, recomputed
   later) until it fits.
2. If nothing was preempted, waiting requests are admitted in arrival order while
   ``max_num_seqs``, the token budget ``max_num_batched_tokens`` and the free block count
   allow. A prompt longer than the remaining budget is prefilled in chunks over several steps.

Because ``max_num_batched_tokens >= max_num_seqs`` and at most one running request (the last
admitted) is ever mid-prefill, every running request in the decode phase is scheduled every
step. A request that could never fit is rejected by ``add_request``; so the oldest request can
always make progress and the loop never spins.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request_id: the request.
        token_ids: the tokens to compute this step (a prompt chunk, or the last sampled token).
        num_computed_tokens: how many tokens already have K/V in the cache; the position of
            ``token_ids[0]``.
        block_table: physical block ids covering ``num_computed_tokens + len(token_ids)``
            tokens. Read-only for the runner.
        do_sample: this step reaches the request's last token, so its logits are sampled.
        sampling_params: the request's parameters.
        num_output_tokens: output tokens generated so far (the index of the token sampled
            this step), which seeds a seeded request's generator.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    do_sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """The contract between scheduler and model runner for one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class Scheduler:
    """Waiting queue, running list, and the per-step plan over one ``BlockManager``."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be resolved before scheduling")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``ValueError`` naming the limit if a request could never be served."""
        max_model_len = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: it must have at least 1 token")
        if num_prompt_tokens + max_tokens > max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} tokens exceeds max_model_len ({max_model_len})")
        # The last sampled token is never fed back, so its K/V never needs a slot.
        num_blocks = self.block_manager.num_blocks_for(num_prompt_tokens + max_tokens - 1)
        if num_blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
                f"{num_blocks} KV blocks, more than the whole KV cache "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens)")

    def add_request(self, request: Request) -> None:
        """Queue a request after ``check_request``; raises ``ValueError`` on a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_request(request.num_prompt_tokens, request.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request with a finished ``status``, free its blocks; ``None`` if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if not output.preempted_request_ids:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running):
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 0:
                if not self._make_room(request, num_new, output):
                    break  # the request preempted itself; everything after it went first
                self._add_scheduled(output, request, num_new)
                budget -= num_new
            index += 1
        return budget

    def _make_room(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Preempt the newest running requests until ``request`` can grow by ``num_new``."""
        num_tokens = request.num_computed_tokens + num_new
        while not self.block_manager.can_allocate(request.request_id, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens, budget)
            if not self.block_manager.can_allocate(request.request_id, num_new):
                break  # arrival order: no one overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(output, request, num_new)
            budget -= num_new

    def _add_scheduled(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        self.block_manager.allocate(request.request_id, end)
        output.scheduled.append(ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end),
            num_computed_tokens=start,
            block_table=self.block_manager.block_table(request.request_id),
            do_sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
        ))

    # ---- after the forward ---------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record a step's results: computed tokens, sampled tokens, finished requests.

        Args:
            output: the step's plan, as returned by ``schedule``.
            sampled: request id -> new token id, for the requests that sampled.

        Returns:
            The requests that got a new token this step (finished ones included, with their
            final status and their blocks already freed).
        """
        updated = []
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(scheduled.token_ids)
            token_id = sampled.get(scheduled.request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                self.finish_request(request.request_id, status)
            updated.append(request)
        return updated

    @staticmethod
    def _stop_status(request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
