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
   A request whose structured-outputs grammar is still compiling (``Request.is_ready``) is
   passed over, keeping its place, until its compile is done.

Because ``max_num_batched_tokens >= max_num_seqs`` and at most one running request (the last
admitted) is ever mid-prefill, every running request in the decode phase is scheduled every
step. A request that could never fit is rejected by ``add_request``; so the oldest request can
always make progress and the loop never spins.

With prefix caching, a request taken from the waiting queue (new or preempted) starts from
the longest run of its full blocks found in the cache: its ``num_computed_tokens`` starts
there, capped so that its last token is computed (its logits are needed), and admission
counts only the blocks it must newly take (a hit on a free cached block takes that block out
of the free pool). After each forward, the blocks that became full are offered to the cache.
A waiting request whose next block another sequence is computing in this very step waits one
step and finds it cached, rather than computing it twice (a burst of requests with one
system prompt computes it once). A request with ``prompt_logprobs`` computes its whole prompt:
a cached block holds K/V, not the logits its tokens' log probabilities come from.

A request with ``n > 1`` is prefilled once, as its sequence 0. The step that finishes its
prompt samples ``n`` tokens from the last position; ``update`` then forks sequences 1..n-1,
which share the prompt's blocks (``BlockManager.fork``) and run as requests of their own.
Admission reserves room in ``max_num_seqs`` for the forks to come.
"""
from __future__ import annotations

from collections import deque

from engine.block_manager import BlockHash, BlockManager, hash_block_tokens, root_hash
from engine.config import SchedulerConfig
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.request import Request, RequestStatus, make_seq_id
from engine.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput


class Scheduler:
    """Waiting queue, running list, and the per-step plan over one ``BlockManager``."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be resolved before scheduling")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # by seq_id
        self._reserved_seq_ids: set[str] = set()  # forks of requests not yet forked
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens of requests looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self._filling: set[BlockHash] = set()  # hashes of blocks this step fills

    # ---- requests in and out -------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        """Raise ``InvalidRequestError`` (``ContextLengthExceededError`` for length limits)
        naming the limit, if a request could never be served."""
        max_model_len = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty: it must have at least 1 token", "prompt")
        if num_prompt_tokens + max_tokens > max_model_len:
            # param "prompt" either way, as OpenAI's context_length_exceeded names the input;
            # where the prompt alone fits, the message says how many output tokens can follow it
            room = max_model_len - num_prompt_tokens
            fits = f": max_tokens can be at most {room} after this prompt" if room >= 1 else ""
            raise ContextLengthExceededError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} tokens exceeds max_model_len ({max_model_len}){fits}",
                "prompt")
        # The last sampled token is never fed back, so its K/V never needs a slot.
        num_blocks = self.block_manager.num_blocks_for(num_prompt_tokens + max_tokens - 1)
        if num_blocks > self.block_manager.num_blocks:
            raise ContextLengthExceededError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
                f"{num_blocks} KV blocks, more than the whole KV cache "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens)",
                "prompt")
        if n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n ({n}) exceeds max_num_seqs ({self.config.max_num_seqs})", "n")

    def add_request(self, request: Request) -> None:
        """Queue a request (its sequence 0) after ``check_request``.

        Raises:
            ValueError: as ``check_request``, or when the request id, or the id one of its
                forks will take, is already in use.
        """
        n = request.sampling_params.n
        seq_ids = [make_seq_id(request.request_id, i) for i in range(n)]
        if any(s in self.requests or s in self._reserved_seq_ids for s in seq_ids):
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use")
        self.check_request(request.num_prompt_tokens, request.max_tokens, n)
        request.num_forks_pending = n - 1
        self._reserved_seq_ids.update(seq_ids[1:])
        self.requests[request.seq_id] = request
        self.waiting.append(request)

    def finish_request(self, seq_id: str, status: RequestStatus) -> Request | None:
        """End a sequence with a finished ``status``, free its blocks; ``None`` if unknown.

        A sequence 0 that ends before forking takes its pending forks with it."""
        request = self.requests.pop(seq_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._release_forks(request)
        self.block_manager.free(seq_id)
        return request

    def _release_forks(self, request: Request) -> None:
        for index in range(1, request.num_forks_pending + 1):
            self._reserved_seq_ids.discard(make_seq_id(request.request_id, index))
        request.num_forks_pending = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduler_output = SchedulerOutput()
        self._filling.clear()
        budget = self._schedule_running(scheduler_output, self.config.max_num_batched_tokens)
        if not scheduler_output.preempted_seq_ids:
            self._schedule_waiting(scheduler_output, budget)
        if self.block_manager.debug_checks:
            self.block_manager.check_invariants(_written_blocks(scheduler_output, self.block_manager.block_size))
        return scheduler_output

    def _schedule_running(self, scheduler_output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running):
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 0:
                if not self._make_room(request, num_new, scheduler_output):
                    break  # the request preempted itself; everything after it went first
                self._add_scheduled(scheduler_output, request, num_new)
                budget -= num_new
            index += 1
        return budget

    def _make_room(self, request: Request, num_new: int, scheduler_output: SchedulerOutput) -> bool:
        """Preempt the newest running requests until ``request`` can grow by ``num_new``."""
        start = request.num_computed_tokens
        while not self.block_manager.can_allocate(request.seq_id, start + num_new, start):
            victim = self.running.pop()
            self._preempt(victim)
            scheduler_output.preempted_seq_ids.append(victim.seq_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.seq_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        request.num_preemptions += 1

    def _schedule_waiting(self, scheduler_output: SchedulerOutput, budget: int) -> None:
        num_seqs = len(self.running) + sum(r.num_forks_pending for r in self.running)
        bm = self.block_manager
        compiling = []  # requests whose grammar is still compiling keep their place
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not request.is_ready:
                compiling.append(self.waiting.popleft())
                continue
            if num_seqs + 1 + request.num_forks_pending > self.config.max_num_seqs:
                break
            hits, num_cached = self._find_cached_prefix(request)
            if request.sampling_params.prompt_logprobs is None and len(hits) < len(request.block_hashes) \
                    and request.block_hashes[len(hits)] in self._filling:
                break  # another sequence computes its next block in this step: a hit next step
            num_new = min(request.num_tokens - num_cached, budget)
            if bm.num_blocks_to_admit(hits, num_cached, num_cached + num_new) > bm.num_free_blocks:
                break  # arrival order: no one overtakes the head of the queue
            num_seqs += 1 + request.num_forks_pending
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            copy = bm.admit(request.seq_id, hits, num_cached, num_cached + num_new)
            if copy is not None:
                scheduler_output.blocks_to_copy.append(copy)
            self._start_after_cached_prefix(request, num_cached)
            self.running.append(request)
            self._add_scheduled(scheduler_output, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

    def _find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks the request can start from, and how many of its tokens they
        cover (at most ``num_tokens - 1``: the last token is computed for its logits). None
        for a request with ``prompt_logprobs``, whose every prompt token needs its logits (vLLM
        skips the lookup for them too); its blocks are still cached for others."""
        if not self.block_manager.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hits = self.block_manager.find_cached_prefix(self._block_hashes(request))
        return hits, min(len(hits) * self.block_manager.block_size, request.num_tokens - 1)

    def _start_after_cached_prefix(self, request: Request, num_cached: int) -> None:
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:  # the first admission's, as vLLM reports it
            request.num_cached_tokens = num_cached
        if self.block_manager.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes of the request's full blocks (prompt and output), extended to its
        current tokens; block ``i``'s chains block ``i - 1``'s, the first the salt's root."""
        hashes, size = request.block_hashes, self.block_manager.block_size
        for index in range(len(hashes), request.num_tokens // size):
            parent = hashes[-1] if hashes else root_hash(request.sampling_params.cache_salt)
            hashes.append(hash_block_tokens(parent, request.token_ids_slice(index * size, (index + 1) * size)))
        return hashes

    def _add_scheduled(self, scheduler_output: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        copy = self.block_manager.copy_on_write(request.seq_id, start)
        if copy is not None:
            scheduler_output.blocks_to_copy.append(copy)
        self.block_manager.allocate(request.seq_id, end)
        if self.block_manager.enable_prefix_caching:
            size = self.block_manager.block_size
            self._filling.update(self._block_hashes(request)[start // size:end // size])
        do_sample = end == request.num_tokens
        scheduler_output.scheduled.append(ScheduledRequest(
            seq_id=request.seq_id,
            token_ids=request.token_ids_slice(start, end),
            num_computed_tokens=start,
            block_table=self.block_manager.block_table(request.seq_id),
            do_sample=do_sample,
            num_samples=1 + request.num_forks_pending if do_sample else 0,
            sampling_row=request.sampling_row,
        ))

    # ---- after the forward ---------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> list[tuple[Request, SampledToken]]:
        """Record a step's results: computed tokens, sampled tokens, forks, finished sequences.

        Args:
            scheduler_output: the step's plan, as returned by ``schedule``.
            runner_output: the tokens drawn for each sequence that sampled.

        Returns:
            ``(sequence, its new token)`` for every sequence that got one this step, new forks
            included; finished ones carry their final status and have freed their blocks.
        """
        updated = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.seq_id)
            if request is None:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(scheduled.token_ids)
            if scheduled.seq_id in runner_output.prompt_logprobs:
                request.add_prompt_logprobs(*runner_output.prompt_logprobs[scheduled.seq_id])
            if self.block_manager.enable_prefix_caching:
                self.block_manager.cache_full_blocks(request.seq_id, self._block_hashes(request),
                                                     request.num_computed_tokens)
            tokens = runner_output.sampled.get(scheduled.seq_id)
            if not tokens:
                continue
            sequences = [request] + self._fork(request, len(tokens) - 1)
            for sequence, token in zip(sequences, tokens, strict=True):
                self._append_token(sequence, token.token_id)
                updated.append((sequence, token))
        if self.block_manager.debug_checks:
            self.block_manager.check_invariants()
        return updated

    def _fork(self, parent: Request, num_forks: int) -> list[Request]:
        """Sequences 1..num_forks of ``parent``'s request, sharing its blocks, running."""
        forks = []
        for index in range(1, num_forks + 1):
            child = Request(request_id=parent.request_id, prompt=parent.prompt,
                            prompt_token_ids=parent.prompt_token_ids,
                            sampling_params=parent.sampling_params,
                            eos_token_id=parent.eos_token_id, max_tokens=parent.max_tokens,
                            index=index, arrival_time=parent.arrival_time,
                            num_computed_tokens=parent.num_computed_tokens,
                            num_cached_tokens=parent.num_cached_tokens,
                            block_hashes=list(parent.block_hashes), status=RequestStatus.RUNNING,
                            # its own matcher, where the parent's is before its first token
                            grammar=None if parent.grammar is None else parent.grammar.fork())
            self._reserved_seq_ids.discard(child.seq_id)
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.requests[child.seq_id] = child
            self.running.append(child)
            forks.append(child)
        parent.num_forks_pending = 0
        return forks

    def _append_token(self, request: Request, token_id: int) -> None:
        request.output_token_ids.append(token_id)
        params = request.sampling_params
        if token_id == request.eos_token_id and not params.ignore_eos:
            self.finish_request(request.seq_id, RequestStatus.FINISHED_STOPPED)
        elif token_id in params.stop_token_ids:
            request.stop_reason = token_id
            self.finish_request(request.seq_id, RequestStatus.FINISHED_STOPPED)
        elif request.num_output_tokens >= request.max_tokens:
            self.finish_request(request.seq_id, RequestStatus.FINISHED_LENGTH)


def _written_blocks(scheduler_output: SchedulerOutput, block_size: int) -> list[int]:
    """The blocks a step's forward writes K/V into."""
    return [block_id for s in scheduler_output.scheduled
            for block_id in s.block_table[s.num_computed_tokens // block_size:
                                          (s.num_computed_tokens + len(s.token_ids) - 1) // block_size + 1]]
