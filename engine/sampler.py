"""Logits to token ids, vectorised over the batch with per-row parameters."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.sampling_params import SamplingParams


def request_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """A generator for token ``index`` of a seeded request.

    Seeding from ``(seed, index)`` rather than keeping a generator per request makes a
    seeded request's output depend only on its prompt, parameters and seed: not on what
    else shares the batch, nor on preemption and recompute.
    """
    return torch.Generator(device).manual_seed(hash((seed, index)) & (2**63 - 1))


class Sampler:
    """Greedy, temperature, top-k and top-p sampling.

    Args:
        device: where logits live.
        seed: seeds the shared generator used by unseeded sampled rows.
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 output_indices: Sequence[int]) -> list[int]:
        """Pick one token per row.

        Args:
            logits: ``[num_rows, vocab_size]`` fp32.
            params: each row's sampling parameters.
            output_indices: each row's index of the token being sampled (for seeds).

        Returns:
            ``num_rows`` token ids.
        """
        greedy = torch.tensor([p.is_greedy for p in params], device=self.device)
        tokens = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return tokens.tolist()
        probs = self._probs(logits, params)
        noise = self._exponential_noise(probs, params, output_indices)
        # Gumbel-max's exponential form: argmax(p / E), E ~ Exp(1), draws from p.
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, tokens, sampled).tolist()

    def _probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params],
                                   device=self.device)
        logits = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        vocab_size = logits.shape[-1]
        if any(0 < k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _truncate(logits, top_k, top_p)
        return torch.softmax(logits, dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, params: Sequence[SamplingParams],
                           output_indices: Sequence[int]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                noise[i].exponential_(generator=request_generator(p.seed, output_indices[i], self.device))
        return noise


def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask to -inf all but each row's top-k tokens and its top-p nucleus.

    The nucleus keeps the smallest prefix of the sorted distribution whose probability
    reaches ``top_p`` (Holtzman et al. 2019), always at least the most likely token.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device)
    k = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_k], device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=logits.device)
    drop = mass_before >= p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
