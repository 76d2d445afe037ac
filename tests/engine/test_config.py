"""Engine settings are written once, in engine/config.py: LLM(...), the command line and the
service's AppConfig are generated from the dataclass fields."""
import dataclasses
import re
import typing

import pytest

from app.config import AppConfig
from engine.__main__ import _parser
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_args


def _dataclass_fields() -> dict[str, dataclasses.Field]:
    fields = {}
    for owner in (EngineConfig, CacheConfig, SchedulerConfig):
        fields.update({f.name: f for f in dataclasses.fields(owner) if f.name not in ("cache", "scheduler")})
    return fields


def test_engine_args_are_exactly_the_dataclass_fields():
    fields = _dataclass_fields()
    assert [a.name for a in engine_args()] == list(fields)
    for arg in engine_args():
        assert arg.default == fields[arg.name].default and arg.help == fields[arg.name].metadata["help"]
        assert arg.help and arg.help.endswith(".")


def test_from_kwargs_routes_every_argument_and_round_trips():
    config = EngineConfig.from_kwargs(dtype="float32", block_size=32, max_num_seqs=8, num_gpu_blocks=64)
    assert (config.dtype, config.cache.block_size, config.scheduler.max_num_seqs,
            config.cache.num_gpu_blocks) == ("float32", 32, 8, 64)
    assert EngineConfig.from_kwargs(**config.to_kwargs()) == config
    assert EngineConfig.from_kwargs() == EngineConfig()
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'"):
        EngineConfig.from_kwargs(max_num_seq=8)
    with pytest.raises(ValueError, match=r"block_size must be one of \(8, 16, 32, 64, 128\); got 12"):
        EngineConfig.from_kwargs(block_size=12)


def test_the_command_line_has_one_option_per_setting_with_its_default_and_choices():
    gen = _parser()._subparsers._group_actions[0].choices["generate"]
    options = {a.dest: a for a in gen._actions}
    defaults = vars(_parser().parse_args(["generate", "--prompt", "x"]))
    for arg in engine_args():
        action = options[arg.name]
        assert action.option_strings[0] == "--" + arg.name.replace("_", "-")
        assert defaults[arg.name] == arg.default
        assert arg.help in action.help
        if arg.choices:
            assert tuple(action.choices) == arg.choices


def test_app_config_has_every_engine_setting_with_its_default_type_and_choices():
    for arg in engine_args():
        field = AppConfig.model_fields[arg.name]
        assert field.default == arg.default and field.description == arg.help
        if arg.choices and isinstance(arg.choices[0], str):
            assert typing.get_origin(field.annotation) is typing.Literal
            assert typing.get_args(field.annotation) == arg.choices
    config = AppConfig.load({"block_size": "32", "dtype": "float32"})
    assert config.engine_config() == EngineConfig.from_kwargs(block_size=32, dtype="float32")


def test_llm_takes_every_engine_setting_by_name():
    from engine.llm import LLM

    # LLM(**kwargs) forwards to from_kwargs: the same names, and the same error for others.
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'"):
        LLM(max_num_seq=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens .16. must be >= max_num_seqs .32."):
        LLM(max_num_seqs=32, max_num_batched_tokens=16)


def test_enable_prefix_caching_is_on_by_default_in_every_front_end(monkeypatch):
    import yaml

    from tests.serve_process import ROOT

    assert EngineConfig().cache.enable_prefix_caching is True
    assert EngineConfig.from_kwargs(enable_prefix_caching=False).cache.enable_prefix_caching is False
    parse = _parser().parse_args
    assert parse(["generate", "--prompt", "x"]).enable_prefix_caching is True
    assert parse(["generate", "--prompt", "x", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert AppConfig.model_fields["enable_prefix_caching"].default is True
    monkeypatch.setenv("MINI_INFER_ENABLE_PREFIX_CACHING", "false")
    assert AppConfig.load().engine_config().cache.enable_prefix_caching is False
    for path in sorted((ROOT / "ray_configs").glob("*.yaml")):
        text = path.read_text()
        yaml.safe_load(text)
        # A Serve config that lists the settings lists this one (serve_local.yaml lists
        # none: AppConfig's defaults and MINI_INFER_<FIELD> decide).
        if "import_path: app:build_app" in text and re.search(r"^\s+args:", text, re.M):
            assert "enable_prefix_caching: true" in text, path.name
