"""A local Hugging Face hub endpoint for tests: enough of the hub's HTTP API that the real huggingface_hub
client (HF_ENDPOINT) lists and downloads a model the test prepared. Test infrastructure, never shipped.

    hub = HfHub(tmp_path / "hub").start()       # a thread serving http://127.0.0.1:<port>
    commit = hub.add_model("org/tiny", folder)  # revision "main"; add_model(..., revision="v1") for more
    env = {"HF_ENDPOINT": hub.endpoint}
    hub.requests                                # every request's path, in order ("/org/tiny/resolve/...")
    hub.log                                     # HubRequest(method, path, range, status, body_bytes)
    hub.file_gets()                             # the GETs of file contents (resolve/), as HubRequest
    hub.token = "hf_secret"                     # from now on, requests need "Authorization: Bearer hf_secret"
    hub.truncate["model.safetensors"] = 1000    # no response sends a byte of that file past offset 1000
    hub.corrupt.add("model.safetensors")        # flip one byte of that file in every response (same size)
    hub.stop()

API served: GET /api/models/ORG/NAME[/revision/REV] (id, sha, siblings with size, blobId and lfs sha256)
and GET|HEAD /ORG/NAME/resolve/REV/FILE (ETag, X-Repo-Commit, Content-Length, Accept-Ranges, Range →
206). A revision is a name given to add_model or a commit sha it returned. Errors carry the hub's
X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound), so the client raises its real exceptions.
Files named *.safetensors, *.bin, *.gguf, *.pt or of 10 MiB and more are "LFS" (sha256); others carry
their git blob sha1."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
LFS_MIN_SIZE = 10 << 20
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class HubRequest(NamedTuple):
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


@dataclass(frozen=True)
class HubFile:
    name: str
    path: Path
    size: int
    sha256: str
    blob_sha1: str

    @property
    def is_lfs(self) -> bool:
        return self.name.endswith(LFS_SUFFIXES) or self.size >= LFS_MIN_SIZE

    def sibling(self) -> dict:
        entry = {"rfilename": self.name, "size": self.size, "blobId": self.blob_sha1}
        if self.is_lfs:
            entry["lfs"] = {"sha256": self.sha256, "size": self.size, "pointerSize": 134}
        return entry


def _hub_file(name: str, path: Path) -> HubFile:
    data = path.read_bytes()
    blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
    return HubFile(name, path, len(data), hashlib.sha256(data).hexdigest(), blob)


class HfHub:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.repos: dict[str, dict[str, str]] = {}  # repo -> revision name or commit -> commit
        self.commits: dict[str, dict[str, HubFile]] = {}  # commit -> files
        self.token: str | None = None
        self.truncate: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.log: list[HubRequest] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> list[str]:
        return [r.path for r in self.log]

    def file_gets(self) -> list[HubRequest]:
        return [r for r in self.log if r.method == "GET" and "/resolve/" in r.path]

    def add_model(self, repo: str, folder: str | Path, revision: str = "main") -> str:
        """Snapshots `folder` as a commit of `repo` under `revision`; returns the commit sha."""
        folder = Path(folder)
        names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        digest = hashlib.sha1(repo.encode())
        for name in names:
            digest.update(name.encode() + b"\0" + hashlib.sha256((folder / name).read_bytes()).digest())
        commit = digest.hexdigest()
        snapshot = self.root / repo.replace("/", "--") / commit
        if not snapshot.exists():
            shutil.copytree(folder, snapshot)
        with self._lock:
            self.commits[commit] = {name: _hub_file(name, snapshot / name) for name in names}
            self.repos.setdefault(repo, {})[revision] = commit
            self.repos[repo][commit] = commit
        return commit

    def start(self) -> HfHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hfhub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> HfHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def record(self, request: HubRequest) -> None:
        with self._lock:
            self.log.append(request)


def _handler_for(hub: HfHub) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler):
        pass

    Handler.hub = hub
    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HfHub

    def log_message(self, format: str, *args: object) -> None:  # quiet: the hub keeps its own log
        pass

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        status, sent = self._route(path, head)
        self.hub.record(HubRequest(self.command, path, self.headers.get("Range"), status, sent))

    def _route(self, path: str, head: bool) -> tuple[int, int]:
        hub = self.hub
        if hub.token is not None:
            auth = self.headers.get("Authorization")
            if auth is None:
                return self._error(401, "RepoNotFound", "Repository not found"), 0
            if auth != f"Bearer {hub.token}":
                return self._error(401, None, "Invalid credentials in Authorization header"), 0
        if match := _INFO.match(path):
            return self._info(match["repo"], match["rev"] or "main"), 0
        if match := _RESOLVE.match(path):
            return self._resolve(match["repo"], match["rev"], match["file"], head)
        return self._error(404, None, "Not found"), 0

    def _commit(self, repo: str, revision: str) -> str | int:
        if repo not in self.hub.repos:
            return self._error(404, "RepoNotFound", "Repository not found")
        if revision not in self.hub.repos[repo]:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return self.hub.repos[repo][revision]

    def _info(self, repo: str, revision: str) -> int:
        commit = self._commit(repo, revision)
        if isinstance(commit, int):
            return commit
        files = self.hub.commits[commit].values()
        body = {
            "_id": commit[:24],
            "id": repo,
            "modelId": repo,
            "sha": commit,
            "private": self.hub.token is not None,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": [f.sibling() for f in files],
        }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return 200

    def _resolve(self, repo: str, revision: str, name: str, head: bool) -> tuple[int, int]:
        commit = self._commit(repo, revision)
        if isinstance(commit, int):
            return commit, 0
        file = self.hub.commits[commit].get(name)
        if file is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist"), 0
        start, end = 0, file.size - 1
        if (wanted := self.headers.get("Range")) is not None:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
            if match is None or int(match[1]) >= file.size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{file.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return 416, 0
            start, end = int(match[1]), min(int(match[2] or file.size - 1), file.size - 1)
        status = 206 if wanted is not None else 200
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{file.sha256 if file.is_lfs else file.blob_sha1}"')
        self.send_header("X-Repo-Commit", commit)
        if file.is_lfs:
            self.send_header("X-Linked-Size", str(file.size))
            self.send_header("X-Linked-Etag", f'"{file.sha256}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{file.size}")
        self.end_headers()
        if head:
            return status, 0
        return status, self._send_body(file, start, end)

    def _send_body(self, file: HubFile, start: int, end: int) -> int:
        data = bytearray(file.path.read_bytes()[start : end + 1])
        if file.name in self.hub.corrupt and data:
            middle = file.size // 2 - start
            if 0 <= middle < len(data):
                data[middle] ^= 0xFF
        cut = self.hub.truncate.get(file.name)
        if cut is not None and end + 1 > cut:
            data = data[: max(cut - start, 0)]
            self.close_connection = True  # the client sees fewer bytes than Content-Length, then EOF
        self.wfile.write(bytes(data))
        self.wfile.flush()
        return len(data)

    def _error(self, status: int, code: str | None, message: str) -> int:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return status
