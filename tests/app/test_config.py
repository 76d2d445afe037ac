"""AppConfig: defaults, MINI_INFER_* environment variables, then serve run arguments."""
import pytest
from pydantic import ValidationError

from app.config import AppConfig


def test_environment_fills_in_and_arguments_win(monkeypatch):
    monkeypatch.setenv("MINI_INFER_MAX_NUM_SEQS", "32")
    monkeypatch.setenv("MINI_INFER_API_KEY", "from-env")
    config = AppConfig.load({"api_key": "from-args", "kv_cache_memory_gb": "0.5"})
    assert (config.max_num_seqs, config.api_key, config.kv_cache_memory_gb) == (32, "from-args", 0.5)
    assert config.engine_capacity == config.max_admitted_requests == 32 + 512
    assert config.engine_max_ongoing_requests == 32 + 512 + 16  # and the control calls' places
    assert config.ingress_max_ongoing_requests == 32 + 512 + 1024
    engine = config.engine_config()
    assert engine.scheduler.max_num_seqs == 32 and engine.cache.kv_cache_memory_gb == 0.5


def test_unknown_and_invalid_settings_name_the_field():
    with pytest.raises(ValidationError, match="max_num_seq"):
        AppConfig.load({"max_num_seq": 4})
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        AppConfig.load({"gpu_memory_utilization": 1.5})
    with pytest.raises(ValidationError, match=r"engine_transport\n  Input should be 'grpc' or 'ray'"):
        AppConfig.load({"engine_transport": "tcp"})
    for window in ("nan", "inf"):  # not "greater than or equal to 0" for nan; inf never streams
        with pytest.raises(ValidationError, match=r"stream_batching_interval_ms\n  Input should be a finite number"):
            AppConfig.load({"stream_batching_interval_ms": window})
    with pytest.raises(ValidationError, match=r"stream_batching_interval_ms\n  Input should be greater than or equal"):
        AppConfig.load({"stream_batching_interval_ms": -1})


def test_allowed_origins_from_text_and_an_origin_that_would_never_match_is_refused(monkeypatch):
    """CORS origins (vLLM's --allowed-origins): ``*`` by default, as vLLM's; a JSON list or
    commas in an environment variable or argument; empty turns CORS off. An origin with a
    path or a trailing slash never equals a browser's ``Origin`` header: an error, not a
    setting that silently allows nothing."""
    assert AppConfig.load().allowed_origins == ["*"]
    monkeypatch.setenv("MINI_INFER_ALLOWED_ORIGINS", "http://a.example, https://b.example:8443")
    assert AppConfig.load().allowed_origins == ["http://a.example", "https://b.example:8443"]
    assert AppConfig.load({"allowed_origins": '["http://c.example"]'}).allowed_origins == ["http://c.example"]
    assert AppConfig.load({"allowed_origins": ""}).allowed_origins == []
    assert AppConfig.load({"allowed_origins": "null,http://[::1]:8080,https://a-b.example:443"}).allowed_origins == [
        "null", "http://[::1]:8080", "https://a-b.example:443"]
    # a trial found these accepted: browsers send scheme and host in lowercase, a real port, no user info
    for never in ("http://a.example/", "HTTP://a.example", "http://A.example", "http://a.example:99999",
                  "http://a.example:0", "http://a.example:abc", "http://user@a.example", "a.example"):
        with pytest.raises(ValidationError, match=r"allowed_origins\n  Value error, '.*' is not an origin as "
                                                  r"browsers send it: `\*`, `null` or scheme://host\[:port\]"):
            AppConfig.load({"allowed_origins": never})
    with pytest.raises(ValidationError, match=r"allowed_origins\n  Value error, not a JSON list of origins"):
        AppConfig.load({"allowed_origins": '["http://a.example"'})


def test_an_unknown_mini_infer_variable_is_an_error_with_the_closest_name(monkeypatch):
    """A misspelt MINI_INFER_API_KEY must not leave the service open without a word."""
    monkeypatch.setenv("MINI_INFER_API_KEYS", "secret-value")
    monkeypatch.setenv("MINI_INFER_ZZZ", "1")
    monkeypatch.setenv("MINI_INFER_CPU_ISA", "avx2")  # read by the kernels, not a field: known
    with pytest.raises(ValidationError) as caught:
        AppConfig.load()
    errors = [(e["loc"], e["msg"], e["input"]) for e in caught.value.errors()]
    assert errors == [
        (("MINI_INFER_API_KEYS",), "not a mini-infer setting; did you mean MINI_INFER_API_KEY?", ""),
        (("MINI_INFER_ZZZ",), "not a mini-infer setting (the settings are AppConfig's fields as MINI_INFER_<FIELD>)",
         "")]
    assert "secret-value" not in str(caught.value)
    monkeypatch.delenv("MINI_INFER_API_KEYS")
    monkeypatch.delenv("MINI_INFER_ZZZ")
    assert AppConfig.load().api_key is None
    # names are exact: a lowercase one is not read, so it is not taken either (a hostile trial's)
    monkeypatch.setenv("MINI_INFER_api_key", "secret-value")
    with pytest.raises(ValidationError) as caught:
        AppConfig.load()
    assert [(e["loc"], e["msg"]) for e in caught.value.errors()] == [
        (("MINI_INFER_api_key",), "not a mini-infer setting; did you mean MINI_INFER_API_KEY?")]
    monkeypatch.delenv("MINI_INFER_api_key")
    # an empty key would serve without one: refused
    monkeypatch.setenv("MINI_INFER_API_KEY", "")
    with pytest.raises(ValidationError, match=r"api_key\n  String should have at least 1 character"):
        AppConfig.load()


def test_the_other_settings_with_choices_are_checked_at_load(monkeypatch):
    """MINI_INFER_CPU_ISA=bogus failed the deployment in tracebacks (a hostile trial); now the
    load that make run's check runs names it."""
    monkeypatch.setenv("MINI_INFER_CPU_ISA", "bogus")
    monkeypatch.setenv("MINI_INFER_FIT_THREADS", "maybe")
    with pytest.raises(ValidationError) as caught:
        AppConfig.load()
    assert [(e["loc"], e["msg"]) for e in caught.value.errors()] == [
        ((), "MINI_INFER_CPU_ISA must be one of auto, avx512_bf16, avx512, avx2, scalar; got 'bogus'"),
        ((), "MINI_INFER_FIT_THREADS must be 0 (always cpus_given() threads) or 1 (fewer while other processes "
             "use the CPUs); got 'maybe'")]
    monkeypatch.setenv("MINI_INFER_CPU_ISA", "scalar")
    monkeypatch.setenv("MINI_INFER_CPU_PREFETCH", "l3")
    monkeypatch.setenv("MINI_INFER_FIT_THREADS", "0")
    with pytest.raises(ValidationError, match="MINI_INFER_CPU_PREFETCH must be one of auto, l1, l2; got 'l3'"):
        AppConfig.load()
    monkeypatch.setenv("MINI_INFER_CPU_PREFETCH", "l2")
    assert AppConfig.load().max_num_seqs > 0


def test_every_mini_infer_variable_the_project_names_is_known():
    """OTHER_SETTINGS lists exactly the MINI_INFER_* variables read outside AppConfig: every
    name the code and docs use is a field or one of them, and each of them is still read."""
    import re
    from pathlib import Path

    from app.config import ENV_PREFIX, OTHER_SETTINGS

    root = Path(__file__).resolve().parents[2]
    # (not kernels/csrc: C++ macros share the prefix; the C++ reads no environment)
    files = [p for folder in ("app", "engine", "kernels", "bench", "loadtest", "scripts", "docs", "tests")
             for p in (root / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".yaml")]
    files += [root / name for name in ("README.md", "Makefile", "Dockerfile")]
    named: dict[str, set[Path]] = {}
    for path in files:
        for name in re.findall(r"\bMINI_INFER_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
            named.setdefault(name, set()).add(path.relative_to(root))
    fields = {ENV_PREFIX + name.upper() for name in AppConfig.model_fields}
    test_names = {"MINI_INFER_API_KEYS", "MINI_INFER_ZZZ", "MINI_INFER_MAX_NUM_SEQ",  # misspelt on purpose
                  "MINI_INFER_KERNEL_TABLE"}  # a C++ macro, read by a kernels test
    assert {n: p for n, p in named.items() if n not in fields | set(OTHER_SETTINGS) | test_names} == {}
    read = {name for name, paths in named.items() for path in paths
            if path.parts[0] not in ("tests", "docs") and path != Path("app/config.py")}
    assert set(OTHER_SETTINGS) - read == set()


@pytest.mark.parametrize("device,cluster_gpus,expected", [
    ("auto", 8.0, True), ("auto", 0.0, False), ("cuda", 0.0, True), ("cpu", 8.0, False)])
def test_engine_placement_follows_the_ray_cluster(monkeypatch, device, cluster_gpus, expected):
    """``auto`` asks the cluster Ray is connected to (GPU workers behind a CPU-only head),
    not the process that builds the app."""
    import ray

    import app

    monkeypatch.delenv("MINI_INFER_FIT_THREADS", raising=False)  # tests/conftest.py sets it
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": cluster_gpus})
    monkeypatch.setattr("torch.cuda.is_available", lambda: not expected)  # must not decide
    assert app.engine_wants_gpu(device) is expected
    options = app.engine_actor_options(AppConfig.load({"device": device, "engine_num_cpus": 2}))
    resources = {"num_gpus": 1} if expected else {"num_cpus": 2}
    assert options == {**resources, "runtime_env": {"env_vars": {
        "GOMP_SPINCOUNT": "30000", "THP_MEM_ALLOC_ENABLE": "1",
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "2147483647"}}}


@pytest.mark.parametrize("device,gpu_ids,expected", [
    ("auto", [0], "cuda"), ("auto", [], "cpu"), ("cuda", [], "cuda"), ("cpu", [3], "cpu")])
def test_replica_resolves_auto_from_its_assigned_gpu(monkeypatch, device, gpu_ids, expected):
    import ray

    from app.engine_server import replica_device

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: gpu_ids)
    assert replica_device(device) == expected


def test_outside_ray_auto_is_left_to_the_engine(monkeypatch):
    import ray

    from app.engine_server import replica_device

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert replica_device("auto") == "auto"


def test_queue_bounds_and_body_limit_follow_the_engine_settings():
    config = AppConfig.load({"max_num_seqs": 2, "max_waiting_requests": 1, "num_engine_replicas": 3})
    assert config.engine_capacity == 2 + 1  # a full batch and the engine's queue
    assert config.engine_max_ongoing_requests == 2 + 1 + 16  # and the control calls' places
    assert config.max_admitted_requests == 3 * (2 + 1)  # what all engine replicas hold
    assert config.ingress_max_ongoing_requests == 3 * (2 + 1) + 1024
    assert config.max_body_bytes(max_model_len=8192) == 64 * 8192 + (1 << 20)
    assert AppConfig.load({"max_request_body_bytes": 1000}).max_body_bytes(8192) == 1000


@pytest.mark.parametrize("settings,expected", [
    ({}, 4.0),  # one replica: every CPU of the largest live node
    ({"num_engine_replicas": 2}, 2.0), ({"num_engine_replicas": 3}, 1.0),
    ({"num_engine_replicas": 5}, 1.0),  # at least 1
    ({"engine_num_cpus": 0.5}, 0.5), ({"engine_num_cpus": 3, "num_engine_replicas": 2}, 3.0)])
def test_engine_num_cpus_defaults_to_the_largest_nodes_cpus_shared_among_the_replicas(
        monkeypatch, settings, expected):
    import ray

    import app

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": False, "Resources": {"CPU": 16.0}},
        {"Alive": True, "Resources": {"CPU": 4.0, "node_b": 1.0}}])
    assert app.largest_node_cpus() == 4.0
    options = app.engine_actor_options(AppConfig.load({"device": "cpu", **settings}))
    assert options["num_cpus"] == expected


def test_outside_ray_the_default_counts_this_machines_cpus_as_ray_would(monkeypatch):
    """``serve run app:deployment`` builds the app before it starts Ray on this machine: the
    count is the one Ray will give that node (cgroup quotas and cpusets included)."""
    import ray
    import ray._private.utils

    import app

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray._private.utils, "get_num_cpus", lambda **kwargs: 3)
    assert app.largest_node_cpus() == 3.0
    assert AppConfig.load({}).engine_num_cpus is None
    assert app.engine_actor_options(AppConfig.load({"device": "cpu"}))["num_cpus"] == 3.0
    assert app.engine_actor_options(AppConfig.load({"device": "cpu", "num_engine_replicas": 2}))["num_cpus"] == 1.0
