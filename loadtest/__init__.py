"""Load tests of the OpenAI endpoint with Locust (``python -m loadtest --help``)."""
