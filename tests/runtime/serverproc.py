"""Start `spyre-runtime serve` as a subprocess on a free loopback port; stop it by PID."""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.cluster.controlplane import Proc, free_port, terminate
from tests.httpclient import LIMITS, openai_client


class ServerProcess:
    def __init__(
        self,
        model_dir: Path,
        env: dict[str, str],
        log_path: Path,
        served_name: str = "tiny",
        extra_args: tuple[str, ...] = (),
        module: str = "spyre_runtime.cli",
        ca_file: Path | None = None,
    ):
        """`ca_file`: the server serves HTTPS with a certificate this CA signed (its health is checked so)."""
        self.port = free_port()
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.base = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.served_name = served_name
        self.health_codes: list[int] = []
        argv = [
            sys.executable,
            "-m",
            module,
            "serve",
            str(model_dir),
            "--port",
            str(self.port),
            "--served-model-name",
            served_name,
            *extra_args,
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        # one client (one SSL context) for the whole wait, with this server's CA (tests/httpclient.py)
        with httpx.Client(verify=self.verify, limits=LIMITS) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                with contextlib.suppress(httpx.HTTPError):
                    code = http.get(self.base + "/health", timeout=2).status_code
                    self.health_codes.append(code)
                    if code == 200:
                        return
                time.sleep(0.1)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    @contextlib.contextmanager
    def serving(self, timeout: float = 300):
        """Waits until ready and yields the server; stops it (by PID) whatever happens."""
        try:
            self.wait_ready(timeout)
            yield self
        finally:
            self.stop()

    def client(self, timeout: float = 60, api_key: str = "unused"):
        """The official client, with no retries; on the shared HTTP client unless the server speaks TLS."""
        if self.verify is True:
            return openai_client(self.base + "/v1", api_key=api_key, timeout=timeout)
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        terminate(Proc("spyre-runtime", self.proc.pid, self.log_path, self.proc), grace=30)
        self._log.close()
