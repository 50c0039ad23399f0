"""`hf://ORG/NAME[@REVISION]` through huggingface_hub: the file list and checksums from
`HfApi.model_info(files_metadata=True)`, each file from its `resolve/<commit>/<name>` URL with Range.

The revision is resolved once to its commit and every file is fetched at that commit, so a branch that
moves during the fetch cannot mix two versions. Checksums: sha256 of LFS files, the git blob sha1 of the
others, as the hub gives them. Token: HF_TOKEN; endpoint: --endpoint, else HF_ENDPOINT, else the hub."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from spyre_runtime.sources.errors import FetchError
from spyre_runtime.sources.remote import Listing, RemoteFile
from spyre_runtime.sources.uri import HfSource

DEFAULT_ENDPOINT = "https://huggingface.co"


class HfStore:
    def __init__(self, source: HfSource, endpoint: str | None, env: Mapping[str, str]) -> None:
        self.source = source
        self.endpoint = (endpoint or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.token = env.get("HF_TOKEN") or None
        self.commit: str | None = None

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
            if sibling.size is None:
                raise FetchError(f"{src.uri}: the hub gave no size for {sibling.rfilename}", transient=True)
            if sibling.lfs is not None:
                files.append(RemoteFile(sibling.rfilename, sibling.size, "sha256", sibling.lfs.sha256))
            elif sibling.blob_id:
                files.append(RemoteFile(sibling.rfilename, sibling.size, "git-sha1", sibling.blob_id))
            else:
                files.append(RemoteFile(sibling.rfilename, sibling.size))
        if not files:
            raise FetchError(f"{src.uri}: the repository has no files at {src.revision}", transient=False)
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
        if isinstance(error, httpx2.TransportError | OSError):
            raise FetchError(f"{what}: network error {at}: {error!r}", transient=True) from error
        return False
