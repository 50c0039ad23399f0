"""A real S3-compatible server for tests: moto in server mode (PyPI `moto[server]`) as a subprocess on
127.0.0.1, with IAM authentication enforced. Test infrastructure, never shipped.

    s3 = S3Server(tmp_path / "s3").start()        # moto on a free port (stopped by PID) behind a proxy thread
    s3.put_folder("models", "tiny", folder)       # bucket created if needed; files >= part_size go multipart
    s3.put_parts("models", "big", data, [70_000, 65_536])  # one multipart upload, parts as given
    env = {**s3.credentials, "AWS_ENDPOINT_URL": s3.endpoint}  # AWS_ACCESS_KEY_ID, ..._SECRET_..., AWS_REGION
    s3.requests                                   # "GET /models/tiny/config.json", ... from moto's own log
    s3.object_gets()                              # the GETs of object contents (not listings), same log
    s3.log                                        # S3Request(method, path, range, status, body_bytes) through
                                                  # s3.endpoint (what a loader asked and got)
    s3.truncate["models/tiny/model.safetensors"] = 1000  # no response through s3.endpoint sends a byte of
                                                  # that object past offset 1000 (then the connection closes)
    s3.corrupt.add("models/tiny/model.safetensors")  # flip the byte in the middle of that object, same size
    s3.stop()

`s3.endpoint` is a small forwarding proxy in the test process in front of moto (`s3.moto_endpoint`): it
passes requests through unchanged (the Host header too, so SigV4 signatures hold), logs them, and cuts
bodies on request. put_folder and client() talk to moto directly.

The server accepts only the access key it made at start (moto's IAM auth: INITIAL_NO_AUTH_ACTION_COUNT,
turned on through /moto-api/reset-auth once the user exists); any other key gets InvalidAccessKeyId and
a wrong secret SignatureDoesNotMatch, as on AWS. Multipart parts may be as small as MIN_PART_SIZE
(S3_UPLOAD_PART_MIN_SIZE), so tiny models exercise multipart ETags. moto runs patched (motoserver.py) so
that an SSE-KMS object's ETag is not its MD5, as on AWS."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

from tests.cluster.controlplane import Proc, _die_with_parent, free_port, terminate

MIN_PART_SIZE = 64 << 10
_MOTO_SERVER = Path(__file__).with_name("motoserver.py")  # moto.server, SSE-KMS ETags as on AWS
REGION = "us-east-1"
_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


class S3Request(NamedTuple):
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


class S3Server:
    def __init__(self, workdir: str | Path, proxy_host: str = "127.0.0.1") -> None:
        """`proxy_host`: where `endpoint` listens (a real node's pods reach the host on its bridge address);
        moto itself stays on 127.0.0.1."""
        self.workdir = Path(workdir)
        self.proxy_host = proxy_host
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "moto.log"
        self.port = 0
        self.credentials: dict[str, str] = {}
        self.log: list[S3Request] = []
        self.truncate: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self._proxy: ThreadingHTTPServer | None = None
        self._proc: Proc | None = None

    @property
    def moto_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"http://{self.proxy_host}:{self._proxy.server_address[1]}"

    def start(self, timeout: float = 120.0) -> S3Server:  # moto's imports take long on a loaded machine
        self.port = free_port()
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(MIN_PART_SIZE), "MOTO_PORT": str(self.port)}
        with open(self.log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, str(_MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self._proc = Proc("moto", popen.pid, self.log_path, popen)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.moto_endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if popen.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto server did not start (exit code {popen.poll()}, {timeout:.0f} s): "
                        f"{self.log_path.read_text()[-2000:]}"
                    ) from None
                time.sleep(0.2)
        self._make_user()
        self._proxy = ThreadingHTTPServer((self.proxy_host, 0), _proxy_handler(self))
        self._proxy.daemon_threads = True
        threading.Thread(target=self._proxy.serve_forever, name="s3proxy", daemon=True).start()
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
            f"{self.moto_endpoint}/moto-api/reset-auth",
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
            endpoint_url=self.moto_endpoint,
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

    def put_parts(self, bucket: str, key: str, data: bytes, part_sizes: list[int], **extra: str) -> str:
        """One multipart upload of `data` cut into parts of `part_sizes` (the last takes the rest; every
        part but the last at least MIN_PART_SIZE); `extra` as for create_multipart_upload
        (ServerSideEncryption="aws:kms", ChecksumAlgorithm="SHA256"...). Returns the ETag."""
        s3 = self.client()
        upload = s3.create_multipart_upload(Bucket=bucket, Key=key, **extra)["UploadId"]
        algorithm = {"ChecksumAlgorithm": extra["ChecksumAlgorithm"]} if "ChecksumAlgorithm" in extra else {}
        parts, start = [], 0
        for number, size in enumerate([*part_sizes, len(data) - sum(part_sizes)], 1):
            body = data[start : start + size]
            start += size
            sent = s3.upload_part(
                Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body, **algorithm
            )
            parts.append(
                {
                    "PartNumber": number,
                    **{
                        k: v
                        for k, v in sent.items()
                        if k == "ETag" or (k.startswith("Checksum") and k != "ChecksumType")
                    },
                }
            )
        done = s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
        return done["ETag"].strip('"')

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
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
            self._proxy = None
        if self._proc is not None:
            terminate(self._proc, grace=10)
            self._proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _proxy_handler(server: S3Server) -> type[BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        pass

    Handler.s3 = server
    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    """Forwards one request to moto as it came (bodies by Content-Length) and its response back."""

    protocol_version = "HTTP/1.1"
    s3: S3Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        upstream = http.client.HTTPConnection("127.0.0.1", self.s3.port, timeout=60)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                upstream.putheader(name, value)
            upstream.endheaders(body)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        total = response.getheader("Content-Range", "").rpartition("/")[2]
        sent = self._cut(data, response.status, int(total) if total.isdigit() else len(data))
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if self.command == "HEAD":
            self.send_header("Content-Length", response.getheader("Content-Length", "0"))
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(sent)
        self.wfile.flush()
        path = self.path.split("?", 1)[0]
        record = S3Request(self.command, path, self.headers.get("Range"), response.status, len(sent))
        self.s3.log.append(record)

    def _cut(self, data: bytes, response_status: int, size: int) -> bytes:
        """The body as sent: whole, or with its middle byte flipped (corrupt), or cut at the object's
        truncation offset (then the connection closes). `size`: the whole object's."""
        key = self.path.split("?", 1)[0].lstrip("/")
        if self.command != "GET" or response_status // 100 != 2:
            return data
        match = re.fullmatch(r"bytes=(\d+)-\d*", self.headers.get("Range") or "bytes=0-")
        start = int(match[1]) if match else 0
        if key in self.s3.corrupt and 0 <= (middle := size // 2 - start) < len(data):
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        cut = self.s3.truncate.get(key)
        if cut is None or start + len(data) <= cut:
            return data
        self.close_connection = True
        return data[: max(cut - start, 0)]
