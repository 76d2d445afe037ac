"""The Ray Serve application: ``serve run app:deployment`` (settings from defaults and
``MINI_INFER_*`` environment variables) or ``serve run app:build_app key=value ...``.

``deployment`` is built on first access (PEP 562), so importing ``app`` or ``app.config``
builds nothing."""
from __future__ import annotations

import functools
import os
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from app.config import AppConfig
from app.engine_server import EngineServer
from app.errors import RETRY_AFTER_S
from app.ingress import OpenAIIngress
from app.router import PrefixAwareRouter
from engine.threads import huge_pages_env, wait_policy_env


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Bind the two deployments: the OpenAI ingress and the engine server.

    Overload is refused at the door: each ingress replica lets through at most what the
    engine replicas hold (``max_num_seqs + max_waiting_requests`` each) and answers any
    further request at once with 503 and ``Retry-After``; Serve's own bounds agree, and send
    an engine replica no more than it holds (docs/DEPLOYMENT.md, "Limits").

    Args:
        args: ``AppConfig`` fields (from ``serve run`` or a Serve config file's ``args``);
            they override ``MINI_INFER_*`` environment variables and the defaults.

    Raises:
        pydantic.ValidationError: naming any unknown or invalid setting.
    """
    config = AppConfig.load(args)
    backpressure = BackpressureConfig(status_code=503, retry_after_s=float(RETRY_AFTER_S))
    engine = serve.deployment(EngineServer).options(
        name="EngineServer", num_replicas=config.num_engine_replicas,
        ray_actor_options=engine_actor_options(config),
        max_ongoing_requests=config.engine_max_ongoing_requests,
        max_queued_requests=config.max_admitted_requests, backpressure_config=backpressure,
        health_check_period_s=5, health_check_timeout_s=30,
        request_router_config=request_router_config(config))
    ingress = OpenAIIngress.options(
        num_replicas=config.num_ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        max_queued_requests=config.ingress_max_ongoing_requests, backpressure_config=backpressure)
    return ingress.bind(engine.bind(config), config)


def request_router_config(config: AppConfig) -> RequestRouterConfig:
    """The engine deployment's request router (``AppConfig.request_router``): ours
    (``app.router.PrefixAwareRouter``) or Serve's default (power of two choices)."""
    if config.resolved_request_router == "pow2":
        return RequestRouterConfig()
    return RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={"block_size": config.block_size,
                               "imbalanced_threshold": config.router_imbalanced_threshold,
                               "replica_capacity": config.engine_capacity})


# The largest request an engine replica's gRPC server takes (Serve's interdeployment
# transport, AppConfig.engine_transport): gRPC's own default is 4 MiB, less than a request body
# may be (AppConfig.max_body_bytes); this is Serve's limit for the senders, 2 GiB - 1 (a signed
# 32-bit length). Bodies are bounded by the ingress before they get here.
GRPC_MAX_MESSAGE_BYTES = (1 << 31) - 1


def engine_actor_options(config: AppConfig) -> dict:
    """Ray options of one engine replica: one GPU (``engine_wants_gpu``), else
    ``engine_num_cpus`` CPUs (by default the largest node's, shared among the replicas:
    ``AppConfig.default_engine_num_cpus``), whose count its torch threads follow; in its environment, the
    OpenMP wait settings and the huge-pages setting before torch loads (``engine.threads``) and
    the largest request its gRPC server takes (``GRPC_MAX_MESSAGE_BYTES``)."""
    if engine_wants_gpu(config.device):
        resources = {"num_gpus": 1}
    elif config.engine_num_cpus is not None:
        resources = {"num_cpus": config.engine_num_cpus}
    else:
        resources = {"num_cpus": config.default_engine_num_cpus(largest_node_cpus())}
    env_vars = {**wait_policy_env(), **huge_pages_env(),
                "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MAX_MESSAGE_BYTES)}
    return {**resources, "runtime_env": {"env_vars": env_vars}}


def largest_node_cpus() -> float:
    """The CPUs of the largest node an engine replica may be placed on, for the default of
    ``engine_num_cpus``: read from the Ray cluster where this process is connected to one (a
    Serve config file's application is built inside the cluster), else this machine's CPUs as
    Ray counts them for a node it starts here (``serve run app:deployment`` imports the app
    before it starts Ray): cgroup quotas and cpusets included (``ray._private.utils.get_num_cpus``),
    else ``os.cpu_count()``."""
    if ray.is_initialized():
        cpus = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node.get("Alive")]
        if cpus:
            return float(max(cpus))
    try:
        from ray._private.utils import get_num_cpus  # Ray's own count; private, so guarded
    except ImportError:
        return float(os.cpu_count() or 1)
    return float(get_num_cpus(override_docker_cpu_warning=True))


def engine_wants_gpu(device: str) -> bool:
    """Whether engine replicas ask Ray for a GPU.

    ``cuda``: yes; ``cpu``: no; ``auto``: when the Ray cluster has a GPU on any node, read
    from the cluster where this process is connected to it (a Serve config file's
    application is built inside the cluster: ``serve run/deploy ray_configs/*.yaml``), so a
    CPU-only head with GPU workers still places engines on GPUs. ``serve run
    app:deployment`` imports this module before it connects to Ray; there ``auto`` asks
    this machine's torch. Each replica then resolves ``auto`` from the GPU Ray gave it
    (``app.engine_server.replica_device``).
    """
    if device != "auto":
        return device == "cuda"
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) >= 1
    import torch

    return torch.cuda.is_available()


@functools.cache
def _default_deployment() -> Application:
    return build_app()


def __getattr__(name: str):
    if name == "deployment":
        return _default_deployment()
    raise AttributeError(f"module 'app' has no attribute {name!r}")

__all__ = ["AppConfig", "build_app", "deployment", "engine_actor_options", "engine_wants_gpu",
           "largest_node_cpus", "request_router_config"]
