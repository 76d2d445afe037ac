"""A two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and a worker
node, each its own raylet, with custom resources ``node_a`` / ``node_b``), and the app deployed
on it from a Serve config as ``serve run <config>`` does. Traffic goes to 127.0.0.1 only; the
cluster's processes are stopped by ``close()`` (``Cluster.shutdown`` kills each node's
processes by handle)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import ray
import requests
import yaml
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve._private import api as serve_api
from ray.serve.schema import ApplicationStatus, ServeDeploySchema

ROOT = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"
METRIC_PUSH_INTERVALS = ("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
                         "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S")


class TwoNodeCluster:
    """``with TwoNodeCluster() as cluster: cluster.deploy(config)``.

    Args:
        head_cpus: CPUs the head node offers (it also runs Serve's controller, proxy and the
            ingress, which ask for none).
        worker_cpus: CPUs the worker node offers.
    """

    def __init__(self, head_cpus: float = 2, worker_cpus: float = 1) -> None:
        # Workers of both raylets import the app from the checkout, as the driver does; Serve's
        # replicas and handles report their ongoing requests every second (default 10 s), so
        # that autoscaling reacts within a test's time.
        self._saved_env = {name: os.environ.get(name) for name in ("PYTHONPATH", *METRIC_PUSH_INTERVALS)}
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        for name in METRIC_PUSH_INTERVALS:
            os.environ[name] = "1"
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "resources": {"node_a": 1}, "include_dashboard": False})
        self.worker = self.cluster.add_node(num_cpus=worker_cpus, resources={"node_b": 1})
        ray.init(address=self.cluster.address)
        self.head_node_id = self.cluster.head_node.node_id
        self.worker_node_id = self.worker.node_id

    def __enter__(self) -> "TwoNodeCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def deploy(self, config: dict, num_engine_replicas: int, timeout: float = 240) -> None:
        """Deploy a Serve config (as loaded from ``ray_configs/*.yaml``) in place of any
        application deployed before, and wait until Serve reports it running, ``/ready``
        answers and ``/stats`` lists ``num_engine_replicas`` engine replicas.

        Raises:
            TimeoutError: not ready in ``timeout`` seconds.
        """
        schema = ServeDeploySchema.model_validate(config)
        client = serve_api.serve_start(http_options=schema.http_options.model_dump(),
                                       proxy_location=schema.proxy_location)
        self.delete_app()  # a fresh app: no replica or cache of the one before answers
        client.deploy_apps(schema, _blocking=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            app = serve.status().applications.get("default")
            if (app is not None and app.status == ApplicationStatus.RUNNING and _ok(URL + "/ready")
                    and len(self.stats()) == num_engine_replicas):
                return
            time.sleep(1.0)
        raise TimeoutError(f"app not ready with {num_engine_replicas} engine replicas in {timeout}s: "
                           f"{serve.status()}")

    def delete_app(self) -> None:
        """Delete the application (its replicas and their caches), if deployed, waiting until
        it is gone."""
        if "default" in serve.status().applications:
            serve.delete("default", _blocking=True)

    def stats(self) -> list[dict]:
        """Every engine replica's ``/stats`` entry (empty while none answers)."""
        try:
            return requests.get(URL + "/stats", timeout=30).json()["replicas"]
        except (requests.RequestException, ValueError, KeyError):
            return []

    def remove_worker(self) -> None:
        """Kill the worker node's raylet and every process on it, at once (no grace)."""
        self.cluster.remove_node(self.worker, allow_graceful=False)


def load_config(name: str, *, args: dict | None = None, engine: dict | None = None,
                ingress: dict | None = None) -> dict:
    """``ray_configs/<name>`` for this cluster: its proxy on the head node only (every node
    of this cluster is 127.0.0.1), ``args`` merged into the application's, ``engine`` and
    ``ingress`` as the deployments' overrides."""
    config = yaml.safe_load((ROOT / "ray_configs" / name).read_text())
    config["proxy_location"] = "HeadOnly"
    app = config["applications"][0]
    app["args"] = {**app.get("args", {}), **(args or {})}
    overrides = {d["name"]: d for d in app.get("deployments", [])}
    for deployment_name, options in (("EngineServer", engine), ("OpenAIIngress", ingress)):
        if options:
            overrides[deployment_name] = {**overrides.get(deployment_name, {"name": deployment_name}), **options}
    app["deployments"] = list(overrides.values())
    return config


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=30).status_code == 200
    except requests.RequestException:
        return False
