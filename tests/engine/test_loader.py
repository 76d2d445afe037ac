"""Model specs: the embedded GGUF, its safetensors cache, transformers directories, dummy
shapes; and the forward of each Llama-family variant against transformers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import DUMMY_SHAPES, load_model
from tests.engine.conftest import assert_idle


def test_default_model_is_smollm2_from_the_wheel(model_dir):
    loaded = load_model("smollm2-135m-instruct", load_weights=False)
    c = loaded.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.vocab_size) == (30, 9, 3, 64, 49152)
    assert loaded.path == model_dir and (model_dir / "model.safetensors").is_file()
    assert loaded.tokenizer.eos_token == "<|im_end|>"


def test_second_load_reads_the_cache_without_converting(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    code = ("import time, engine.loader as l; t = time.perf_counter(); m = l.load_model(); "
            "print(len(m.state_dict), round(time.perf_counter() - t, 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TQDM_DISABLE": "1"})
    num_tensors, seconds = out.stdout.split()
    assert int(num_tensors) == 272 and float(seconds) < 20
    assert "Converting" not in out.stderr
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("shape", ["qwen2.5-7b", "llama-3-8b", "smollm2-135m"])
def test_dummy_shapes_have_the_published_dimensions(shape):
    loaded = load_model(f"dummy:{shape}")
    assert loaded.state_dict is None and loaded.tokenizer is None
    expected = {k: v for k, v in DUMMY_SHAPES[shape].items() if k != "rope_parameters"}
    for key, value in expected.items():
        assert getattr(loaded.config, key) == value, key
    if shape == "qwen2.5-7b":
        assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads,
                loaded.config.hidden_size // loaded.config.num_attention_heads) == (28, 4, 128)


def test_unknown_specs_name_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="dummy:<shape>"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="unknown dummy shape 'gpt5'"):
        load_model("dummy:gpt5")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def _hf_model_dir(tmp_path, shape: str):
    """A transformers model of a tiny shape with random weights, saved as a directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(DUMMY_SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases too, so that loading them is checked
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("shape, overrides", [
    ("tiny-llama", {}),
    ("tiny-qwen2", {}),  # q/k/v biases, tied embeddings
    ("tiny-llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}}),
])
def test_transformers_directory_matches_transformers_generate(tmp_path, shape, overrides, monkeypatch):
    fields = dict(DUMMY_SHAPES[shape], **overrides)
    monkeypatch.setitem(DUMMY_SHAPES, shape, fields)
    hf = _hf_model_dir(tmp_path, shape)
    hf.generation_config.eos_token_id = None
    prompts = [[5, 17, 300, 2, 9], list(range(40, 140)), [7]]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=8, num_gpu_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_idle(llm)


def test_dummy_model_generates_from_token_ids():
    llm = LLM(model="dummy:tiny-llama", dtype="float32")
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        llm.generate([[1, 512]], use_tqdm=False)
    assert_idle(llm)
