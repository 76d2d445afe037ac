"""Model definitions. Every supported architecture is a Llama-family decoder."""
from __future__ import annotations

from engine.models.llama import AttentionMetadata, LlamaForCausalLM, can_prepack_weights, head_dim_of

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def build_model(config, max_position: int) -> LlamaForCausalLM:
    """Instantiate the model class for a transformers config.

    Raises:
        ValueError: for a ``model_type`` outside ``SUPPORTED_MODEL_TYPES``.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return LlamaForCausalLM(config, max_position)


__all__ = ["AttentionMetadata", "LlamaForCausalLM", "build_model", "can_prepack_weights", "head_dim_of",
           "SUPPORTED_MODEL_TYPES"]
