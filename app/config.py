"""The application's settings: one pydantic model, filled from (lowest to highest priority)
its defaults, ``MINI_INFER_<FIELD>`` environment variables, and ``serve run`` arguments or a
Serve config file's ``args``.

The engine's settings are not written here: ``AppConfig`` takes one field per engine
argument of ``engine.config`` (name, type, default, allowed values as a ``Literal``, help as
the description), so that a setting added there appears here too.
"""
from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from engine.config import EngineConfig, engine_args

ENV_PREFIX = "MINI_INFER_"


class ServiceSettings(BaseModel):
    """Settings of the service around the engine; ``AppConfig`` adds the engine's own."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    served_model_name: str | None = Field(None, description="The name clients pass as "
                                          "`model`; defaults to `model`.")
    max_waiting_requests: int = Field(512, ge=0, description="Requests an engine replica may "
                                      "queue before new ones get 503 with Retry-After.")
    num_engine_replicas: int = Field(1, ge=1, description="Engine replicas (each holds a model).")
    num_ingress_replicas: int = Field(1, ge=1, description="OpenAI front-end replicas.")
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per engine replica "
                                   "on CPU-only nodes.")
    api_key: str | None = Field(None, description="If set, requests need "
                                "`Authorization: Bearer <api_key>`.")

    @model_validator(mode="after")
    def _valid_engine_config(self):
        self.engine_config()  # its ValueError names the setting; pydantic reports it
        return self

    @classmethod
    def load(cls, args: dict[str, Any] | None = None) -> "AppConfig":
        """Defaults, overridden by ``MINI_INFER_*`` environment variables, overridden by
        ``args``.

        Raises:
            pydantic.ValidationError: naming the field, for a bad value or an unknown name.
        """
        values = {name: os.environ[ENV_PREFIX + name.upper()] for name in cls.model_fields
                  if ENV_PREFIX + name.upper() in os.environ}
        values.update(args or {})
        return cls.model_validate(values)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's per-replica concurrency limit for the engine: room for a full batch and the
        engine's own queue, so the engine (not Serve's default of 5) decides admission."""
        return self.max_num_seqs + self.max_waiting_requests + 16

    def engine_config(self) -> EngineConfig:
        """The engine's settings.

        Raises:
            ValueError: naming an invalid engine setting.
        """
        return EngineConfig.from_kwargs(**{arg.name: getattr(self, arg.name) for arg in engine_args()})


def _engine_fields() -> dict[str, Any]:
    """pydantic field definitions for every engine argument: text choices become a
    ``Literal``; numeric choices (``block_size``) stay numbers that ``MINI_INFER_*`` strings
    convert to, checked by ``EngineConfig``."""
    fields = {}
    for arg in engine_args():
        textual = arg.choices and all(isinstance(c, str) for c in arg.choices)
        annotation = Literal[arg.choices] if textual else arg.type
        fields[arg.name] = (annotation, Field(arg.default, description=arg.help))
    return fields


AppConfig = create_model("AppConfig", __base__=ServiceSettings, __module__=__name__,
                         __doc__="Settings of the OpenAI-compatible service "
                                 "(``serve run app:build_app key=value``).",
                         **_engine_fields())
