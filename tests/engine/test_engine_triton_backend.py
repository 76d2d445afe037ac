"""The engine end to end with ``attention_backend="triton"`` (under the interpreter on a CPU):
greedy tokens identical to the torch backend, across blocks, chunked prefill and a batch."""
import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [[7], list(range(3, 18)), list(range(20, 36)), list(range(40, 57)), list(range(60, 100))]


def _generate(model: str, backend: str, scale_attention: float = 1.0) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", attention_backend=backend, block_size=16,
              num_gpu_blocks=32, max_num_batched_tokens=32, max_num_seqs=8)
    _make_attention_matter(llm.llm_engine.model_runner.model, scale_attention)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert llm.llm_engine.model_runner.backend == backend
    return [o.outputs[0].token_ids for o in outputs]


def _make_attention_matter(model, scale_attention: float) -> None:
    """Dummy N(0, 0.02) weights leave attention too weak to move the argmax; N(0, 0.3)
    projections make every token depend on its context (seeded: both backends get the
    same weights). They are drawn on the CPU and copied, so a model on a GPU gets the same
    values (a CPU generator cannot fill a CUDA tensor in place). ``scale_attention``
    perturbs the softmax scale, for the control test."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    for layer in model.layers:
        layer.self_attn.scale *= scale_attention


@pytest.mark.parametrize("model", ["dummy:tiny-llama", "dummy:tiny-qwen2"])
def test_triton_and_torch_backends_give_identical_greedy_tokens(model):
    torch_tokens = _generate(model, "torch")
    assert all(len(t) == 12 for t in torch_tokens)
    assert _generate(model, "triton") == torch_tokens


def test_the_comparison_can_fail():
    """Control: an attention that is off by a softmax scale of 0.9 changes the tokens."""
    assert _generate("dummy:tiny-llama", "torch", scale_attention=0.9) != \
        _generate("dummy:tiny-llama", "torch")
