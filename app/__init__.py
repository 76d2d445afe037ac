"""The Ray Serve application: ``serve run app:deployment`` (settings from defaults and
``MINI_INFER_*`` environment variables) or ``serve run app:build_app key=value ...``."""
from __future__ import annotations

from typing import Any, Optional

import torch
from ray import serve
from ray.serve import Application

from app.config import AppConfig
from app.engine_server import EngineServer
from app.ingress import OpenAIIngress


def build_app(args: Optional[dict[str, Any]] = None) -> Application:
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


deployment = build_app()

__all__ = ["AppConfig", "build_app", "deployment"]
