"""The main application started by the README's main command (``make run``), shared by the
tests of this package over real HTTP."""
import pytest

from tests.serve_process import ServeProcess

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="package")
def api():
    """The service; ``metrics_at_start`` is its ``GET /metrics`` right after it is ready."""
    import requests

    with ServeProcess(["make", "run"]) as app:
        app.metrics_at_start = requests.get(app.url + "/metrics", timeout=30).text
        yield app


@pytest.fixture(scope="package")
def client(api):
    from openai import OpenAI

    return OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def tokenizer():
    from engine.loader import load_model

    return load_model(MODEL, load_weights=False).tokenizer


def nested_objects(depth: int) -> dict:
    """A JSON schema of ``depth`` nested objects: 2 * depth + 1 levels of dicts."""
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema
