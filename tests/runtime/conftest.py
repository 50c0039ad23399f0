"""Runtime fixtures: a seeded tiny model folder, made once per session (the HTTP layer's shared servers are
entrypoints/conftest.py's), and the C++ extension's whole build loaded before any test runs."""

import pytest
from spyre_runtime.executor.kernels import paged_attention
from spyre_runtime.testing.models import write_tiny_model


@pytest.fixture(scope="session", autouse=True)
def whole_kernel_build():
    """The extension's whole build, loaded first in every test process: an executor that started first would
    build (and load) only its own dtypes' paths, and the kernel tests call the ops with every dtype."""
    paged_attention.kernel()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)
