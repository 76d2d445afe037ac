"""AppConfig: defaults, MINI_INFER_* environment variables, then serve run arguments."""
import pytest
from pydantic import ValidationError

from app.config import AppConfig


def test_environment_fills_in_and_arguments_win(monkeypatch):
    monkeypatch.setenv("MINI_INFER_MAX_NUM_SEQS", "32")
    monkeypatch.setenv("MINI_INFER_API_KEY", "from-env")
    config = AppConfig.load({"api_key": "from-args", "kv_cache_memory_gb": "0.5"})
    assert (config.max_num_seqs, config.api_key, config.kv_cache_memory_gb) == (32, "from-args", 0.5)
    assert config.max_ongoing_requests == 32 + 512 + 16
    engine = config.engine_config()
    assert engine.scheduler.max_num_seqs == 32 and engine.cache.kv_cache_memory_gb == 0.5


def test_unknown_and_invalid_settings_name_the_field():
    with pytest.raises(ValidationError, match="max_num_seq"):
        AppConfig.load({"max_num_seq": 4})
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        AppConfig.load({"gpu_memory_utilization": 1.5})
