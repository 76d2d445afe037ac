"""Invariant 1: greedy fp32 output equals transformers' generate(), token for token, alone
and in any batch, across block boundaries, chunked prefill and preemption."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import HF_BATCH, MAX_TOKENS, PROMPT_LENGTHS, assert_idle, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_lengths_cover_block_boundaries(mixed_prompts):
    assert [len(p) for p in mixed_prompts] == PROMPT_LENGTHS
    assert {15, 16, 17, 31, 32, 33} <= set(PROMPT_LENGTHS) and max(PROMPT_LENGTHS) >= 400


@pytest.mark.slow
def test_the_batched_reference_equals_transformers_one_prompt_at_a_time(hf_model, mixed_prompts, hf_expected):
    # The most padded row of a reference batch: the 1-token prompt among 24-token ones, and
    # the first of the last batch (128 tokens among 450).
    assert PROMPT_LENGTHS[0] == 1 and PROMPT_LENGTHS[HF_BATCH - 1] == 24
    for index in (0, len(PROMPT_LENGTHS) - HF_BATCH):
        assert hf_greedy(hf_model, mixed_prompts[index], MAX_TOKENS) == hf_expected[index], index


# Batch-1 runs of the prompts whose lengths sit at the edges: one token, either side of a
# block's end (16, 32), and the longest; test_one_batch_matches_transformers runs every length.
# (All 18 alone took 65-101 s of the suite on a 2-core EPYC; these 7 take about a third.)
ALONE_LENGTHS = (1, 15, 16, 17, 32, 33, 450)


@pytest.mark.slow
def test_each_prompt_alone_matches_transformers(llm, mixed_prompts, hf_expected):
    alone = [(p, e) for p, e in zip(mixed_prompts, hf_expected, strict=True) if len(p) in ALONE_LENGTHS]
    assert len(alone) == len(ALONE_LENGTHS)
    for prompt, expected in alone:
        (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert output.outputs[0].finish_reason == "length"
    assert_idle(llm)


@pytest.mark.slow  # transformers' reference generations (hf_expected) take ~30 s to make
def test_one_batch_matches_transformers(llm, mixed_prompts, hf_expected):
    outputs = llm.generate(mixed_prompts, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_expected
    assert [o.prompt_token_ids for o in outputs] == mixed_prompts
    assert_idle(llm)


@pytest.mark.slow
def test_preemption_keeps_output_identical(mixed_prompts, hf_expected):
    # 40 blocks of 16 = 640 slots: the 450-token prompt alone needs 31 blocks, so the batch
    # cannot all fit and running requests get preempted and recomputed.
    llm = LLM(dtype="float32", num_gpu_blocks=40)
    outputs = llm.generate(mixed_prompts, GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats()["num_preemptions"] >= 1
    assert _token_ids(outputs) == hf_expected
    assert_idle(llm)


@pytest.mark.slow
def test_chunked_prefill_keeps_output_identical(mixed_prompts, hf_expected):
    # A 64-token budget splits every prompt over 64 tokens into chunks (450 -> 8 chunks).
    llm = LLM(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)
    outputs = llm.generate(mixed_prompts, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_expected
    assert_idle(llm)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(mixed_prompts, hf_expected, block_size):
    llm = LLM(dtype="float32", block_size=block_size, num_gpu_blocks=4096 // block_size)
    outputs = llm.generate(mixed_prompts[:9], GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_expected[:9]
    assert_idle(llm)
