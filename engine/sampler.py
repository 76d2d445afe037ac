"""Logits to tokens, vectorised over the batch with per-row parameters.

The order of processing, per row, is ``SamplingParams``'s docstring: the structured-outputs
token bitmask, logit bias, the ``min_tokens`` mask, repetition then presence/frequency penalties, logprobs, then greedy
argmax or temperature, top-k/top-p/min-p truncation and a draw.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from engine.sampling_params import SamplingParams
from engine.scheduler_output import SampledToken, SamplingRow

if TYPE_CHECKING:
    from engine.structured_outputs import StepBitmask


def request_generator(seed: int, seq_index: int, token_index: int, device: torch.device) -> torch.Generator:
    """The generator for token ``token_index`` of sequence ``seq_index`` of a seeded request.

    Seeding from ``(seed, seq_index, token_index)`` instead of keeping a generator per
    request makes a seeded request's output depend only on its prompt, parameters and seed:
    not on what else shares the batch, nor on preemption and recompute.
    """
    return torch.Generator(device).manual_seed(hash((seed, seq_index, token_index)) & (2**63 - 1))


class Sampler:
    """Picks one token per row.

    Args:
        device: where logits live.
        seed: seeds the shared generator of unseeded sampled rows.
        argmax_rows: ``logits [n, vocab] (fp32, or the model's dtype) -> int64 [n]``, the
            same answer as ``torch.argmax(logits, dim=-1)``; the CPU backend passes its C++
            one (``kernels.cpu_attention.argmax_rows``: 0.10 against torch's 0.84 ms for 64
            rows of 49,152 fp32 on docs/PERFORMANCE.md's AMD EPYC). Default: ``torch.argmax``.
    """

    def __init__(self, device: torch.device, seed: int,
                 argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.argmax_rows = argmax_rows or (lambda logits: logits.argmax(dim=-1))

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 grammar_bitmask: StepBitmask | None = None) -> list[SampledToken]:
        """Process ``logits`` and draw one token per row.

        Args:
            logits: ``[num_rows, vocab_size]`` in fp32 (modified in place) or another float
                dtype (the model's: taken to fp32 first, unless every row is plain greedy).
            grammar_bitmask: the constrained rows' token bitmasks
                (``engine.structured_outputs.GrammarBitmask.fill``), if any row has one.

        Returns:
            One ``SampledToken`` per row, with logprobs where the row's params ask for them.
        """
        if grammar_bitmask is None and all(_plain_greedy(r) for r in rows):
            # No processor changes a logit and the argmax of bf16 values is that of their
            # exact fp32 copies: 64 rows of SmolLM2's 49,152 without the 12 MB fp32 copy,
            # 0.20 against 0.67 ms (Xeon with AMX, 2 threads).
            return [SampledToken(t) for t in self.argmax_rows(logits).tolist()]
        logits = logits.float()  # no copy when fp32
        if grammar_bitmask is not None:
            apply_grammar_bitmask(logits, grammar_bitmask)
        params = [r.params for r in rows]
        apply_logit_bias(logits, params)
        apply_min_tokens(logits, rows)
        apply_penalties(logits, rows)
        logprobs = self._logprobs(logits, params)
        greedy = torch.tensor([p.is_greedy for p in params], device=self.device)
        tokens = self.argmax_rows(logits)
        if not bool(greedy.all()):
            tokens = torch.where(greedy, tokens, self._draw(logits, rows))
        token_ids = tokens.tolist()
        return [self._sampled(token_id, row, logprobs.get(i))
                for i, (token_id, row) in enumerate(zip(token_ids, rows, strict=True))]

    # ---- drawing -------------------------------------------------------------------------

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One draw per row (greedy rows' draws are discarded by the caller)."""
        probs = sampling_probs(logits, [r.params for r in rows])
        # Exponential race (the Gumbel-max trick): argmax(p / E), E ~ Exp(1), draws from p.
        return self.argmax_rows(probs / self._exponential_noise(probs, rows))

    def _exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                generator = request_generator(row.params.seed, row.seq_index,
                                              len(row.output_token_ids), self.device)
                noise[i].exponential_(generator=generator)
        return noise

    # ---- logprobs ------------------------------------------------------------------------

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> dict[int, torch.Tensor]:
        """Row -> log-softmax of the processed logits, for rows that asked for logprobs."""
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return {}
        return dict(zip(wanted, torch.log_softmax(logits[wanted], dim=-1), strict=True))

    def _sampled(self, token_id: int, row: SamplingRow, logprobs: torch.Tensor | None) -> SampledToken:
        if logprobs is None:
            return SampledToken(token_id)
        target = torch.tensor([token_id], device=self.device)
        return logprob_tokens(logprobs[None], target, row.params.logprobs)[0]


def logprob_tokens(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[SampledToken]:
    """Each row's token with its log probability, rank and top alternatives.

    Args:
        logprobs: ``[rows, vocab]`` log probabilities (fp32).
        token_ids: ``[rows]`` int64, the token of each row (sampled, or the prompt's next).
        num_top: alternatives per row, most likely first (0: none).

    Returns:
        One ``SampledToken`` per row; its rank is 1 + the tokens strictly more likely (ties
        share the best rank, as vLLM's ``batched_count_greater_than``).
    """
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_ids: list[list[int]] = [[] for _ in ranks]
    top_values: list[list[float]] = [[] for _ in ranks]
    if num_top:
        top = torch.topk(logprobs, num_top, dim=1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [SampledToken(token_id, logprob=value, rank=rank, top_logprobs=list(zip(ids, values, strict=True)))
            for token_id, value, rank, ids, values in zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks,
                                                          top_ids, top_values, strict=True)]


def _plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is the argmax of its raw logits: greedy, with none of the
    processors below acting on it and no logprobs."""
    p = row.params
    return (p.is_greedy and p.logprobs is None and not p.logit_bias and not p.needs_penalties
            and len(row.output_token_ids) >= p.min_tokens and row.grammar is None)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``[num_rows, vocab_size]`` probabilities after temperature and truncation.

    Greedy rows never divide by their temperature: they use 1 (their row is unused). Every
    row keeps at least its most likely token, so no row is all -inf and none is NaN.
    """
    temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params],
                               device=logits.device)
    logits = logits / temperature[:, None]
    vocab_size = logits.shape[-1]
    if any(0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        logits = truncate(logits, [p.top_k for p in params], [p.top_p for p in params],
                          [p.min_p for p in params])
    return torch.softmax(logits, dim=-1)


# ---- logits processors (in place, on [num_rows, vocab_size] fp32) ---------------------------

def apply_grammar_bitmask(logits: torch.Tensor, grammar_bitmask: StepBitmask) -> None:
    """Set to -inf, in the constrained rows, every token their grammar forbids: one batched
    call of xgrammar's kernel (C++ on the CPU, Triton on CUDA) over all those rows."""
    import xgrammar  # loaded already: the bitmask came from it

    xgrammar.apply_token_bitmask_inplace(logits, grammar_bitmask.bitmask, indices=grammar_bitmask.indices,
                                         vocab_size=logits.shape[-1])


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` (token id -> bias)."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Forbid EOS (unless ``ignore_eos``, or a grammar decides where EOS may come) and
    ``stop_token_ids`` until ``min_tokens`` exist."""
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            stops = list(p.stop_token_ids)
            constrained = row.grammar is not None and row.grammar.is_active
            if row.eos_token_id is not None and not p.ignore_eos and not constrained:
                stops.append(row.eos_token_id)
            logits[i, stops] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition (transformers' semantics, over prompt and output tokens), then presence and
    frequency penalties (OpenAI's, over output tokens)."""
    penalized = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not penalized:
        return
    device, vocab_size = logits.device, logits.shape[-1]
    sub = logits[penalized]
    output_counts = _token_counts([rows[i].output_token_ids for i in penalized], vocab_size, device)
    seen = _token_counts([rows[i].prompt_token_ids for i in penalized], vocab_size, device) > 0
    seen |= output_counts > 0
    repetition = _column([rows[i].params.repetition_penalty for i in penalized], device)
    penalized_logits = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalized_logits, sub)
    presence = _column([rows[i].params.presence_penalty for i in penalized], device)
    frequency = _column([rows[i].params.frequency_penalty for i in penalized], device)
    sub -= presence * (output_counts > 0) + frequency * output_counts
    logits[penalized] = sub


def _token_counts(sequences: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """``[len(sequences), vocab_size]`` fp32: occurrences of each token id per sequence."""
    counts = torch.zeros(len(sequences), vocab_size + 1, device=device)
    longest = max((len(s) for s in sequences), default=0)
    if longest:
        ids = torch.full((len(sequences), longest), vocab_size, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        ids = ids.to(device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]  # the last column counted the padding


def _column(values: list[float], device) -> torch.Tensor:
    return torch.tensor(values, device=device)[:, None]


def truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float],
             min_p: list[float]) -> torch.Tensor:
    """Mask to -inf all but each row's top-k tokens, its top-p nucleus and its min-p set.

    The nucleus is the smallest prefix of the sorted distribution whose probability reaches
    ``top_p`` (Holtzman et al. 2019); min-p keeps tokens whose probability is at least
    ``min_p`` times the largest (Nguyen et al. 2024). The most likely token always stays, so
    every row keeps a finite distribution. ``top_k`` beyond the vocabulary is off.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=device)
    k = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_k], device=device)
    drop = ranks[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= _column(top_p, device)
    drop |= probs < _column(min_p, device) * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
