"""Runtime fixtures: a seeded tiny model folder, made once per session; a server of it with hermes tool
calling, one per module that asks."""

import pytest
from spyre_runtime.testing.models import write_tiny_model

from tests.runtime.serverproc import ServerProcess

# eager, static shapes: room for a chat template with tools and 128 new tokens
TOOL_SERVER_ENV = {
    "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "256",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "128",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="module")
def tool_server(tiny_model, tmp_path_factory):
    """The tiny model served with --enable-auto-tool-choice --tool-call-parser hermes."""
    log = tmp_path_factory.mktemp("tool-server") / "server.log"
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    srv = ServerProcess(tiny_model, TOOL_SERVER_ENV, log, extra_args=args)
    with srv.serving():
        yield srv
