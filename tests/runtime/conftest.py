"""Runtime fixtures: a seeded tiny model folder, made once per session (the HTTP layer's shared servers are
entrypoints/conftest.py's)."""

import pytest
from spyre_runtime.testing.models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)
