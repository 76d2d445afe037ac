"""``prompt_logprobs``: each prompt token's log probability given the tokens before it, checked
against transformers' fp32 logits, through chunked prefill, the prefix cache, preemption and
n > 1."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS, RequestOutputKind
from tests.engine.conftest import assert_idle

TOP = 3


@pytest.fixture(scope="module")
def hf_logprobs(hf_model):
    """``prompt -> [len(prompt), vocab]`` fp32 log-softmax of transformers' logits."""
    def compute(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return compute


def assert_matches_transformers(prompt_logprobs, prompt: list[int], expected: torch.Tensor, top: int) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        row, token = expected[position - 1], prompt[position]
        entry = prompt_logprobs[position]
        ids = list(entry)
        assert ids[0] == token  # the prompt's own token first
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        best = torch.topk(row, top)
        assert [i for i in ids if entry[i].rank <= top] == \
            [token] * (entry[token].rank <= top) + [i for i in best.indices.tolist() if i != token]
        for token_id, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
        assert len(entry) == top + (entry[token].rank > top)


def test_prompt_logprobs_equal_transformers_through_chunked_prefill(mixed_prompts, hf_logprobs):
    # 16 tokens a step: the 97-token prompt is 7 chunks, each chunk's last position giving the
    # next chunk's first token; a one-token prompt has only the None.
    llm = LLM(dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [mixed_prompts[i] for i in (0, 1, 4, 11)]  # 1, 7, 24 and 97 tokens
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_matches_transformers(output.prompt_logprobs, prompt, hf_logprobs(prompt), TOP)
    assert outputs[0].prompt_logprobs == [None]
    assert_idle(llm)


def test_zero_alternatives_and_the_generated_tokens_unchanged(llm, mixed_prompts, hf_logprobs):
    prompt = mixed_prompts[5]  # 24 tokens
    greedy = SamplingParams(temperature=0, max_tokens=6)
    with_prompt = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0), use_tqdm=False)[0]
    plain = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    assert with_prompt.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt_logprobs is None
    assert_matches_transformers(with_prompt.prompt_logprobs, prompt, hf_logprobs(prompt), 0)


def test_a_request_with_prompt_logprobs_does_not_read_the_prefix_cache(mixed_prompts, hf_logprobs):
    llm = LLM(dtype="float32", enable_prefix_caching=True)
    prompt = {"prompt_token_ids": mixed_prompts[11]}  # 97 tokens: 6 full blocks of 16
    greedy = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].num_cached_tokens == 0
    asked = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                         use_tqdm=False)[0]
    assert asked.num_cached_tokens == 0  # computed whole: a cached block has no logits
    assert_matches_transformers(asked.prompt_logprobs, mixed_prompts[11], hf_logprobs(mixed_prompts[11]), 1)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].num_cached_tokens == 96
    assert_idle(llm)


def test_preemption_adds_no_entry_twice(mixed_prompts, hf_logprobs):
    # 40 blocks of 16: the three prompts' 37 blocks fit, their outputs' next 9 do not, so
    # some are preempted and their prompts computed again.
    prompts = mixed_prompts[-6:-3]  # 128, 200 and 256 tokens
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, prompt_logprobs=2)
    tight = LLM(dtype="float32", num_gpu_blocks=40)
    outputs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.llm_engine.stats()["num_preemptions"] >= 1
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_matches_transformers(output.prompt_logprobs, prompt, hf_logprobs(prompt), 2)
    assert_idle(tight)


def test_a_delta_request_gets_them_once_with_n(llm, mixed_prompts):
    engine = llm.llm_engine
    prompt = mixed_prompts[2]  # 15 tokens
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=3, prompt_logprobs=1,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta-prompt-logprobs", {"prompt_token_ids": prompt}, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [output.prompt_logprobs for output in engine.step()]
    assert len(seen) >= 2 and all(p is None for p in seen[1:])
    assert len(seen[0]) == 15 and seen[0][0] is None
    cumulative = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.8, seed=1, n=3, max_tokens=3, prompt_logprobs=1), use_tqdm=False)[0]
    assert [list(e or {}) for e in cumulative.prompt_logprobs] == [list(e or {}) for e in seen[0]]


@pytest.mark.parametrize("value, message", [(-1, r"an integer in \[0, 20\]; got -1"),
                                            (MAX_LOGPROBS + 1, r"an integer in \[0, 20\]; got 21"),
                                            (1.5, "an integer or None; got 1.5")])
def test_out_of_range_names_the_field(value, message):
    with pytest.raises(InvalidRequestError, match=f"^prompt_logprobs must be {message}$"):
        SamplingParams(prompt_logprobs=value)
