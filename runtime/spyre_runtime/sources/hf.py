"""`hf://ORG/NAME[@REVISION]` through huggingface_hub: the file list and checksums from
`HfApi.model_info(files_metadata=True)`, each file from its `resolve/<commit>/<name>` URL with Range.

The revision is resolved once to its commit and every file is fetched at that commit, so a branch that
moves during the fetch cannot mix two versions. Checksums: sha256 of LFS files, the git blob sha1 of the
others, as the hub gives them. Token: HF_TOKEN; endpoint: --endpoint, else HF_ENDPOINT, else the hub.

Only the files the runtime reads are fetched (and counted in the space check): the top-level `*.json`
(config, tokenizer, generation config, the safetensors index, processor and sentence-transformers files),
`*.jinja` chat templates, the tokenizer's `*.model`, `*.tiktoken`, `vocab.txt` and `merges.txt`,
`*.safetensors` but `consolidated*.safetensors` (Mistral's own format, a second copy of the weights), and
the sentence-transformers modules' `<n>_<Name>/config.json`. Not `original/*.pth`, `*.gguf`, `*.bin`,
`*.pt` or anything else. SPYRE_FETCH_INCLUDE adds glob patterns, comma-separated (`original/*.pth,*.gguf`;
`**` takes the whole repository); a pattern matches a path of as many `/`-separated parts as it has.

HF_HUB_OFFLINE=1 fails at once (exit 2): the loader would only reach the hub."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from fnmatch import fnmatchcase

from spyre_runtime.sources.errors import NO_ROUTE_HINT, FetchError, unreachable
from spyre_runtime.sources.remote import Listing, RemoteFile
from spyre_runtime.sources.uri import HfSource

DEFAULT_ENDPOINT = "https://huggingface.co"
INCLUDE_ENV = "SPYRE_FETCH_INCLUDE"
RUNTIME_FILES = (
    "*.json",
    "*.jinja",
    "additional_chat_templates/*.jinja",
    "*.model",
    "*.tiktoken",
    "vocab.txt",
    "merges.txt",
    "*.safetensors",
    "[0-9]*_*/config.json",
)
NOT_READ = ("consolidated*.safetensors",)


def matches(name: str, pattern: str) -> bool:
    """fnmatch on a whole path of as many parts as the pattern: `*.json` is top-level only."""
    return pattern == "**" or (name.count("/") == pattern.count("/") and fnmatchcase(name, pattern))


def wanted(name: str, extra: tuple[str, ...] = ()) -> bool:
    """Whether the runtime reads `name` (or SPYRE_FETCH_INCLUDE asks for it)."""
    if any(matches(name, p) for p in extra):
        return True
    return any(matches(name, p) for p in RUNTIME_FILES) and not any(matches(name, p) for p in NOT_READ)


class HfStore:
    def __init__(self, source: HfSource, endpoint: str | None, env: Mapping[str, str]) -> None:
        self.source = source
        self.endpoint = (endpoint or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.token = env.get("HF_TOKEN") or None
        self.commit: str | None = None
        self.include = tuple(p.strip() for p in env.get(INCLUDE_ENV, "").split(",") if p.strip())
        if env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            raise FetchError(
                f"{source.uri}: HF_HUB_OFFLINE={env['HF_HUB_OFFLINE']} forbids reaching the hub at "
                f"{self.endpoint}; unset it, or {NO_ROUTE_HINT}",
                transient=False,
            )

    def listing(self) -> Listing:
        from huggingface_hub import HfApi

        src = self.source
        with _HfErrors(self, None):
            info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
                src.repo_id, revision=src.revision, files_metadata=True, token=self.token or False
            )
        self.commit = info.sha or src.revision
        files = []
        for sibling in info.siblings or []:
            if not wanted(sibling.rfilename, self.include):
                continue
            if sibling.size is None:
                raise FetchError(f"{src.uri}: the hub gave no size for {sibling.rfilename}", transient=True)
            if sibling.lfs is not None:
                files.append(RemoteFile(sibling.rfilename, sibling.size, "sha256", sibling.lfs.sha256))
            elif sibling.blob_id:
                files.append(RemoteFile(sibling.rfilename, sibling.size, "git-sha1", sibling.blob_id))
            else:
                files.append(RemoteFile(sibling.rfilename, sibling.size))
        if not files:
            listed = len(info.siblings or [])
            raise FetchError(
                f"{src.uri}: the repository has no files the runtime reads at {src.revision} ({listed} "
                f"files listed; {INCLUDE_ENV} adds patterns)",
                transient=False,
            )
        return Listing(revision=src.revision, commit=self.commit, files=tuple(files))

    def open(self, file: RemoteFile, offset: int) -> Iterator[bytes]:
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        url = hf_hub_url(self.source.repo_id, file.name, revision=self.commit, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token or False, library_name="spyre-serve")
        if offset:
            headers["Range"] = f"bytes={offset}-"
        with (
            _HfErrors(self, file.name),
            get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as response,
        ):
            hf_raise_for_status(response)
            if offset and response.status_code != 206:
                raise FetchError(
                    f"{self.source.uri}: file {file.name}: the server ignored the Range request",
                    transient=True,
                )
            yield from response.iter_bytes()  # as they arrive: a cut transfer keeps what came


class _HfErrors:
    """Maps huggingface_hub's and its HTTP client's exceptions to FetchError."""

    def __init__(self, store: HfStore, name: str | None) -> None:
        self.store = store
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, FetchError | GeneratorExit):
            return False
        import httpx2
        from huggingface_hub import errors

        src, at = self.store.source, f"at {self.store.endpoint}"
        what = f"{src.uri}: file {self.name}" if self.name else src.uri
        if isinstance(error, errors.RevisionNotFoundError):
            raise FetchError(f"{src.uri}: revision {src.revision!r} not found {at}", transient=False)
        if isinstance(error, errors.GatedRepoError):
            raise FetchError(f"{src.uri}: gated repository, HF_TOKEN has no access {at}", transient=False)
        if isinstance(error, errors.RepositoryNotFoundError):
            hint = "or HF_TOKEN has no access" if self.store.token else "or it is private: set HF_TOKEN"
            raise FetchError(f"{src.uri}: repository not found ({hint}) {at}", transient=False)
        if isinstance(error, errors.EntryNotFoundError):
            raise FetchError(f"{what}: not found {at}", transient=False)
        if isinstance(error, errors.HfHubHTTPError):
            status = error.response.status_code if error.response is not None else 0
            if status in (401, 403):
                raise FetchError(
                    f"{what}: access denied (HTTP {status}: check HF_TOKEN) {at}", transient=False
                )
            if status == 404:
                raise FetchError(f"{what}: not found {at}", transient=False)
            raise FetchError(f"{what}: HTTP {status} {at}", transient=status >= 500 or status == 429)
        if isinstance(error, errors.OfflineModeIsEnabled):
            raise FetchError(
                f"{src.uri}: offline mode forbids reaching {at}; {NO_ROUTE_HINT}", transient=False
            )
        if isinstance(error, httpx2.ConnectError | httpx2.ConnectTimeout | ConnectionRefusedError):
            raise unreachable(src.uri, self.store.endpoint, error) from error
        if isinstance(error, httpx2.TransportError | OSError):
            raise FetchError(f"{what}: network error {at}: {error!r}", transient=True) from error
        return False
