"""Sampler basics: greedy, top-k/top-p truncation, seeded generators."""
import torch

from engine.sampler import Sampler, _truncate
from engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, -1.0, 4.0, 4.5]])


def test_greedy_rows_take_the_argmax():
    sampler = Sampler(torch.device("cpu"), seed=0)
    assert sampler(LOGITS, [SamplingParams(temperature=0)] * 2, [0, 0]) == [1, 3]


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    inf = float("-inf")
    out = _truncate(LOGITS, top_k=[2, -1], top_p=[1.0, 1.0])
    assert out[0].tolist() == [inf, 3.0, 2.0, inf] and out[1].tolist() == LOGITS[1].tolist()
    # row 1 probabilities: 4.5 -> 0.62, 4.0 -> 0.38: a nucleus of 0.5 keeps only the first
    out = _truncate(LOGITS, top_k=[-1, -1], top_p=[1.0, 0.5])
    assert out[1].tolist() == [inf, inf, inf, 4.5]


def test_top_k_one_and_tiny_top_p_equal_greedy():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert sampler(logits, [params] * 16, list(range(16))) == greedy


def test_seeded_rows_repeat_whatever_shares_the_batch():
    logits = torch.zeros(4, 1000)  # uniform: the draw is all randomness
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    a = Sampler(torch.device("cpu"), seed=0)(logits[:1], [seeded], [5])
    b = Sampler(torch.device("cpu"), seed=99)(logits, [other, seeded, other, other], [0, 5, 1, 2])
    assert a[0] == b[1]
    c = Sampler(torch.device("cpu"), seed=0)(logits[:1], [seeded], [6])
    d = Sampler(torch.device("cpu"), seed=0)(logits[:1], [SamplingParams(temperature=1.0, seed=4321)], [5])
    assert c[0] != a[0] or d[0] != a[0]  # a different step or seed draws anew
