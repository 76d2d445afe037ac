"""The Ray Serve application: ``serve run app:deployment`` (settings from defaults and
``MINI_INFER_*`` environment variables) or ``serve run app:build_app key=value ...``.

``deployment`` is built on first access (PEP 562), so importing ``app`` or ``app.config``
builds nothing."""
from __future__ import annotations

import functools
from typing import Any

import torch
from ray import serve
from ray.serve import Application

from app.config import AppConfig
from app.engine_server import EngineServer
from app.ingress import OpenAIIngress


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Bind the two deployments: the OpenAI ingress and the engine server.

    Args:
        args: ``AppConfig`` fields (from ``serve run`` or a Serve config file's ``args``);
            they override ``MINI_INFER_*`` environment variables and the defaults.

    Raises:
        pydantic.ValidationError: naming any unknown or invalid setting.
    """
    config = AppConfig.load(args)
    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    actor_options = {"num_gpus": 1} if on_gpu else {"num_cpus": config.engine_num_cpus}
    engine = serve.deployment(EngineServer).options(
        name="EngineServer", num_replicas=config.num_engine_replicas,
        ray_actor_options=actor_options, max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=5, health_check_timeout_s=30)
    ingress = OpenAIIngress.options(
        num_replicas=config.num_ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=config.max_ongoing_requests * config.num_engine_replicas)
    return ingress.bind(engine.bind(config), config)


@functools.cache
def _default_deployment() -> Application:
    return build_app()


def __getattr__(name: str):
    if name == "deployment":
        return _default_deployment()
    raise AttributeError(f"module 'app' has no attribute {name!r}")

__all__ = ["AppConfig", "build_app", "deployment"]
