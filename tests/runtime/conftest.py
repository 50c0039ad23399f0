"""Runtime fixtures: a seeded tiny model folder, made once per session (the HTTP layer's shared servers are
entrypoints/conftest.py's), and the C++ extension's whole build loaded before any test runs."""

import pytest
import torch
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


@pytest.fixture(params=[True, False], ids=["bf16-dot", "bf16-widened"])
def bf16_dot(request):
    """The extension's bfloat16 paths on the CPU's bf16 dot product where it has one
    (kernels/paged_attention.cpp `bf16_dot_on`), then widened to float32 as every other CPU runs them:
    whether the dot product is in force."""
    assert paged_attention.kernel() is not None, "the runtime's C++ extension did not build here"
    try:
        yield torch.ops.spyre_kernels.set_bf16_dot(request.param)
    finally:
        torch.ops.spyre_kernels.set_bf16_dot(True)
