"""The serving process keeps a step's freed tensors in the heap (loader.configure_allocator): a sampled step's
transient tensors are not faulted in and zeroed again every step, unless the user's own GLIBC_TUNABLES sets
glibc's malloc."""

import os
import subprocess
import sys

from spyre_runtime.executor.loader import configure_allocator

# 40 sampled steps of 32 rows over a 49,152-token vocabulary, an activation between them, after the process
# configured its threads (and so its allocator) as the engine does; -> the minor faults of the 40 steps
STEPS = """
import resource, torch
from spyre_runtime.config import load_config
from spyre_runtime.executor.loader import configure_threads
from spyre_runtime.request import Request
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.sampling.sampler import sample
configure_threads(load_config("/m", environ={"SENDNN_INFERENCE_NUM_CPUS": "2"}))
rows = [Request(f"r{i}", [1, 2], SamplingParams(temperature=1.0)) for i in range(32)]
logits, x, w = torch.randn(32, 49152).bfloat16(), torch.randn(288, 576), torch.randn(576, 3072)
for _ in range(3):
    sample(logits, rows), x @ w
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    sample(logits, rows), x @ w
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(env: dict) -> int:
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | env
    argv = [sys.executable, "-c", STEPS]
    out = subprocess.run(argv, capture_output=True, text=True, env=environ, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_sampled_steps_do_not_fault_their_tensors_in_again():
    # with glibc's own thresholds (GLIBC_TUNABLES=glibc.malloc.arena_test=8, so left alone) these 40 steps
    # faulted 153,000 to 315,000 pages in here; with ours, 1 to 3,073 (a 12 MB region once). A step's
    # float32 logits are 1,536 pages: faulting them in again in a fifth of the steps would be 12,288
    assert faults({}) < 40 * 1_536 // 5


def test_the_users_malloc_tunables_win():
    assert configure_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) is False
    assert configure_allocator({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1"}) is True
