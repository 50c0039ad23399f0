"""`spyre-runtime` with one fault planted for tests (test infrastructure, never shipped): once the file
named by SPYRE_TEST_FAULT_FILE exists, the executor's next step raises, as a broken card or a bug would.
Everything else is the real server."""

import os
import sys
from pathlib import Path

from spyre_runtime import cli
from spyre_runtime.executor import model_executor as executor


def plant_fault(flag: Path) -> None:
    real_execute = executor.ModelExecutor.execute

    def execute(self, step):
        if flag.exists():
            raise RuntimeError("injected fault: the forward pass failed")
        return real_execute(self, step)

    executor.ModelExecutor.execute = execute


if __name__ == "__main__":
    plant_fault(Path(os.environ["SPYRE_TEST_FAULT_FILE"]))
    sys.exit(cli.main(sys.argv[1:]))
