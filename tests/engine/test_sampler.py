"""Logits processors on hand-computed tensors, and the sampler's batch behaviour."""
import math

import pytest
import torch

from engine.sampler import Sampler, apply_logit_bias, apply_min_tokens, apply_penalties, sampling_probs, truncate
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SamplingRow
from kernels import cpu_attention

INF = float("-inf")
CPU = torch.device("cpu")


def row(params=None, prompt=(), output=(), seq_index=0, eos=None):
    return SamplingRow(params or SamplingParams(), list(prompt), list(output), seq_index, eos)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 0.5]])
    apply_penalties(logits, [row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])])
    assert logits.tolist() == [[1.0, -4.0, 0.5]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [row(params, prompt=[0, 0, 3], output=[1, 1, 2])])
    assert logits.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_penalties_leave_other_rows_alone():
    logits = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    apply_penalties(logits, [row(), row(SamplingParams(repetition_penalty=2.0), output=[1])])
    assert logits.tolist() == [[1.0, 1.0], [1.0, 0.5]]


def test_logit_bias_adds_per_token():
    logits = torch.zeros(2, 4)
    apply_logit_bias(logits, [SamplingParams(logit_bias={3: 5.0, 0: -100}), SamplingParams()])
    assert logits.tolist() == [[-100.0, 0.0, 0.0, 5.0], [0.0] * 4]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[1])
    logits = torch.zeros(4, 4)
    apply_min_tokens(logits, [row(params, output=[3], eos=2), row(params, output=[3, 3], eos=2),
                              row(SamplingParams(min_tokens=2, ignore_eos=True), eos=2), row(eos=2)])
    assert logits.tolist() == [[0, INF, INF, 0], [0] * 4, [0] * 4, [0] * 4]


def test_top_k_top_p_and_min_p_keep_exactly_the_expected_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda out: torch.isfinite(out[0]).tolist()  # noqa: E731
    assert kept(truncate(logits, [2], [1.0], [0.0])) == [True, True, False, False]
    assert kept(truncate(logits, [-1], [0.8], [0.0])) == [True, True, False, False]
    assert kept(truncate(logits, [-1], [0.81], [0.0])) == [True, True, True, False]
    assert kept(truncate(logits, [-1], [1.0], [0.2])) == [True, True, True, False]
    assert kept(truncate(logits, [10**7], [1.0], [0.0])) == [True] * 4


def test_top_k_one_and_tiny_top_p_equal_greedy():
    sampler = Sampler(CPU, seed=0)
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        assert [t.token_id for t in sampler(logits.clone(), [row(params)] * 16)] == greedy


@pytest.mark.skipif(not cpu_attention.is_available(), reason="the C++ CPU kernels must build")
def test_the_cpu_backends_argmax_draws_what_torchs_does():
    """The engine's CPU sampler (kernels.cpu_attention.argmax_rows) against torch.argmax:
    greedy rows, seeded draws (the Gumbel-max argmax), and a batch mixing both."""
    logits = torch.randn(8, 3_000, generator=torch.Generator().manual_seed(4)) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11),
              SamplingParams(temperature=0.7, top_k=50, seed=12), SamplingParams(temperature=0.0)] * 2
    rows = [row(p, seq_index=i) for i, p in enumerate(params)]
    ours = Sampler(CPU, seed=0, argmax_rows=cpu_attention.argmax_rows)(logits.clone(), rows)
    theirs = Sampler(CPU, seed=0)(logits.clone(), rows)
    assert [t.token_id for t in ours] == [t.token_id for t in theirs]
    assert [t.token_id for t in ours][0] == int(logits[0].argmax())


@pytest.mark.skipif(not cpu_attention.is_available(), reason="the C++ CPU kernels must build")
@pytest.mark.parametrize("argmax_rows", [None, cpu_attention.argmax_rows], ids=["torch", "cpu-backend"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_plain_greedy_rows_take_their_argmax_others_are_processed_in_fp32(argmax_rows, dtype):
    """A batch of plain greedy rows takes the argmax of the model-dtype logits as they are (no
    fp32 copy); a batch where any row is processed (here a logit bias, a penalty, min_tokens,
    logprobs, a draw) takes them to fp32 first and leaves the 16-bit tensor unchanged."""
    logits = (torch.randn(4, 3_000, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    before = logits.clone()
    sampler = Sampler(CPU, seed=0, argmax_rows=argmax_rows)
    greedy = logits.float().argmax(-1).tolist()
    assert [t.token_id for t in sampler(logits, [row(SamplingParams(temperature=0.0))] * 4)] == greedy
    top = greedy[0]
    processed = [SamplingParams(temperature=0.0, logit_bias={top: -100.0}),
                 SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
                 SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[top]),
                 SamplingParams(temperature=0.0, logprobs=1)]
    for params in processed:
        tokens = sampler(logits, [row(params, output=[top], seq_index=i) for i in range(4)])
        assert torch.equal(logits, before)
        if params.logprobs is None:
            assert tokens[0].token_id != top
        else:
            assert [t.token_id for t in tokens] == greedy
            assert tokens[0].logprob == pytest.approx(float(torch.log_softmax(logits[0].float(), -1)[top]))
    drawn = sampler(logits, [row(SamplingParams(temperature=0.0))] * 3 + [row(SamplingParams(seed=1))])
    assert [t.token_id for t in drawn][:3] == greedy[:3]


def test_top_k_beyond_the_vocabulary_is_off():
    sampler = Sampler(CPU, seed=0)
    tokens = sampler(torch.zeros(2, 50), [row(SamplingParams(top_k=10**7, seed=3))] * 2)
    assert all(0 <= t.token_id < 50 for t in tokens)


def test_mixed_batch_stays_finite_and_greedy_rows_match_their_solo_runs():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2)) * 8
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
              SamplingParams(temperature=1e-5, top_k=3),
              SamplingParams(temperature=0.8, top_k=20, min_tokens=4),
              SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, top_p=0.5, min_p=0.1),
              SamplingParams(temperature=1e-5)]
    rows = [row(p, prompt=[1, 2], output=[5], eos=0) for p in params]
    processed = logits.clone()
    apply_min_tokens(processed, rows)
    assert torch.isfinite(sampling_probs(processed, params)).all()
    batch = Sampler(CPU, seed=0)(logits.clone(), rows)
    for i in (0, 3):
        (solo,) = Sampler(CPU, seed=123)(logits[i:i + 1].clone(), [rows[i]])
        assert batch[i].token_id == solo.token_id
    # temperature 1e-5 with top_k=3: the draw is effectively the argmax
    assert batch[1].token_id == logits[1].argmax().item()


def test_logprobs_are_taken_after_penalties_and_before_temperature():
    logits = torch.tensor([[3.0, 1.0, 2.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=1, repetition_penalty=2.0, logprobs=2)
    (token,) = Sampler(CPU, seed=0)(logits.clone(), [row(params, prompt=[0])])
    processed = torch.tensor([1.5, 1.0, 2.0, -1.0])  # token 0 seen: 3.0 / 2
    expected = torch.log_softmax(processed, -1)
    assert token.token_id == 2 and token.rank == 1
    assert token.logprob == pytest.approx(expected[2].item())
    assert [t for t, _ in token.top_logprobs] == [2, 0]
    assert [lp for _, lp in token.top_logprobs] == pytest.approx([expected[2].item(), expected[0].item()])
    assert math.isclose(sum(math.exp(v) for v in expected.tolist()), 1.0, rel_tol=1e-6)


def test_sampled_token_rank_counts_better_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    params = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0, 2: -100.0}, logprobs=0)
    (token,) = Sampler(CPU, seed=0)(logits.clone(), [row(params)])
    assert token.token_id == 3 and token.rank == 1 and token.top_logprobs == []


def test_seeded_rows_repeat_whatever_shares_the_batch():
    logits = torch.zeros(4, 1000)  # uniform: the draw is all randomness
    seeded = SamplingParams(seed=1234)
    other = SamplingParams()
    a = Sampler(CPU, seed=0)(logits[:1].clone(), [row(seeded, output=[1] * 5)])
    b = Sampler(CPU, seed=99)(logits.clone(), [row(other), row(seeded, output=[1] * 5), row(other), row(other)])
    assert a[0].token_id == b[1].token_id
    draws = {Sampler(CPU, seed=0)(logits[:1].clone(), [row(p, output=[1] * k, seq_index=i)])[0].token_id
             for p, k, i in [(seeded, 5, 0), (seeded, 6, 0), (seeded, 5, 1), (SamplingParams(seed=4321), 5, 0)]}
    assert len(draws) == 4  # another step, sequence or seed draws anew
