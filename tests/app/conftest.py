"""The main application started by the README's main command (``make run``), shared by the
tests of this package over real HTTP."""
import pytest

from tests.serve_process import ServeProcess

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="package")
def api():
    with ServeProcess(["make", "run"]) as app:
        yield app


@pytest.fixture(scope="package")
def client(api):
    from openai import OpenAI

    return OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def tokenizer():
    from engine.loader import load_model

    return load_model(MODEL, load_weights=False).tokenizer
