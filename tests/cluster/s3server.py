"""A real S3-compatible server for tests: moto in server mode (PyPI `moto[server]`) as a subprocess on
127.0.0.1, with IAM authentication enforced. Test infrastructure, never shipped.

    s3 = S3Server(tmp_path / "s3").start()        # http://127.0.0.1:<free port>, stopped by PID
    s3.put_folder("models", "tiny", folder)       # bucket created if needed; files >= part_size go multipart
    env = {**s3.credentials, "AWS_ENDPOINT_URL": s3.endpoint}  # AWS_ACCESS_KEY_ID, ..._SECRET_..., AWS_REGION
    s3.requests                                   # "GET /models/tiny/config.json", ... from the server's log
    s3.object_gets()                              # the GETs of object contents (not listings)
    s3.stop()

The server accepts only the access key it made at start (moto's IAM auth: INITIAL_NO_AUTH_ACTION_COUNT,
turned on through /moto-api/reset-auth once the user exists); any other key gets InvalidAccessKeyId and
a wrong secret SignatureDoesNotMatch, as on AWS. Multipart parts may be as small as MIN_PART_SIZE
(S3_UPLOAD_PART_MIN_SIZE), so tiny models exercise multipart ETags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.cluster.controlplane import Proc, _die_with_parent, free_port, terminate

MIN_PART_SIZE = 64 << 10
REGION = "us-east-1"
_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')


class S3Server:
    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "moto.log"
        self.port = 0
        self.credentials: dict[str, str] = {}
        self._proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> S3Server:
        self.port = free_port()
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(MIN_PART_SIZE), "MOTO_PORT": str(self.port)}
        with open(self.log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self._proc = Proc("moto", popen.pid, self.log_path, popen)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if popen.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto server did not start: {self.log_path.read_text()[-2000:]}"
                    ) from None
                time.sleep(0.2)
        self._make_user()
        return self

    def _make_user(self) -> None:
        """An IAM user allowed everything, its access key, then authentication on for every request."""
        iam = self._client("iam", {"AWS_ACCESS_KEY_ID": "setup", "AWS_SECRET_ACCESS_KEY": "setup"})
        iam.create_user(UserName="loader")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="loader", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="loader")["AccessKey"]
        self.credentials = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_REGION": REGION,
        }
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form body would hide the count from moto
        )
        urllib.request.urlopen(request, timeout=10).close()

    def _client(self, service: str, credentials: dict[str, str] | None = None):
        import boto3

        creds = credentials or self.credentials
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        )

    def client(self):
        """A boto3 S3 client with the server's credentials."""
        return self._client("s3")

    def put_folder(self, bucket: str, prefix: str, path: str | Path, part_size: int = MIN_PART_SIZE) -> int:
        """Uploads every file under `path` to s3://bucket/prefix/...; files of `part_size` bytes and more
        as multipart uploads of that part size. Returns the number of files."""
        from boto3.s3.transfer import TransferConfig

        s3 = self.client()
        existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
        config = TransferConfig(
            multipart_threshold=part_size, multipart_chunksize=part_size, use_threads=False
        )
        files = [p for p in sorted(Path(path).rglob("*")) if p.is_file()]
        for file in files:
            key = "/".join(filter(None, [prefix.strip("/"), file.relative_to(path).as_posix()]))
            s3.upload_file(str(file), bucket, key, Config=config)
        return len(files)

    @property
    def requests(self) -> list[str]:
        """Every request the server logged, as "METHOD /path?query", in order."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [f"{m['method']} {m['path']}" for m in _LINE.finditer(text)]

    def object_gets(self, bucket: str | None = None) -> list[str]:
        """GETs of object contents: a path with a key and no listing query."""
        gets = []
        for line in self.requests:
            method, path = line.split(" ", 1)
            parts = path.split("?", 1)[0].strip("/").split("/", 1)
            if method == "GET" and len(parts) == 2 and (bucket is None or parts[0] == bucket):
                gets.append(line)
        return gets

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc, grace=10)
            self._proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
