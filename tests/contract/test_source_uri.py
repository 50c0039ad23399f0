"""One grammar for a model source URI (issue 37): the CRD's pattern and CEL rules (crds/spyremodels.yaml), the
operator (its spec parser) and the runtime's loader (`fetch-model`) give the same answer on the same string:
refused by all three, or accepted by all three with the same parts. The loader fetches hf:// and s3:// only,
so it refuses the other schemes by design, and says so."""

from __future__ import annotations

import re

import pytest
import yaml
from spyre_contract.source_uri import SourceError, parse_source_uri
from spyre_operator.spec.model_spec import InvalidSpec
from spyre_operator.spec.parse import parse_spec
from spyre_runtime.sources.errors import FetchError
from spyre_runtime.sources.uri import HfSource, S3Source, parse_source

from tests.conftest import REPO

SHAPES = {"mode": "static", "shapes": [{"promptLength": 64, "newTokens": 8, "batchSize": 1}]}
DIGEST = "sha256:" + "a" * 64

# the string, then None (refused) or the parts every reader must agree on
TABLE = [
    ("pvc://models/granite/3b", {"scheme": "pvc", "claim": "models", "path": "granite/3b"}),
    ("pvc://models/", {"scheme": "pvc", "claim": "models", "path": ""}),
    ("pvc://Models/x", None),
    ("file:///var/models/granite", {"scheme": "file", "path": "/var/models/granite"}),
    ("file://relative", None),
    ("oci://quay.io/org/granite:1.0", {"scheme": "oci", "image": "quay.io/org/granite:1.0"}),
    (
        f"oci://localhost:5000/granite@{DIGEST}",
        {"scheme": "oci", "image": f"localhost:5000/granite@{DIGEST}"},
    ),
    ("oci://quay.io/Org/model", None),
    ("oci://granite:1", None),
    # hf: the Hub's id rules; no revision is the Hub's default, main
    (
        "hf://ibm-granite/granite-3.3-2b",
        {"scheme": "hf", "repo": "ibm-granite/granite-3.3-2b", "revision": "main"},
    ),
    ("hf://org/m@v1.2", {"scheme": "hf", "repo": "org/m", "revision": "v1.2"}),
    ("hf://org/model@refs/pr/1", {"scheme": "hf", "repo": "org/model", "revision": "refs/pr/1"}),
    ("hf://Org_1/Model.v2", {"scheme": "hf", "repo": "Org_1/Model.v2", "revision": "main"}),
    ("hf://org/name/", None),  # the loader took a trailing slash, the operator and the CRD did not
    ("hf://_org/name", None),  # the loader took '_' first, the Hub does not
    ("hf://org/name@", None),
    ("hf://org/name@-x", None),
    ("hf://org", None),
    ("hf://ibm--granite/model", None),  # the CRD took '--', the operator and the Hub do not
    ("hf://org/a..b", None),
    ("hf://org/" + "n" * 97, None),  # at most 96 characters a part
    # s3: a bucket name, then the model's folder (required); a trailing slash is dropped
    ("s3://models.team-a/granite/3b/", {"scheme": "s3", "bucket": "models.team-a", "prefix": "granite/3b"}),
    ("s3://bucket/tiny", {"scheme": "s3", "bucket": "bucket", "prefix": "tiny"}),
    ("s3://bucket", None),  # the loader took a whole bucket, the operator and the CRD did not
    ("s3://bucket/", None),
    ("s3://bucket//", None),
    ("s3://ab/model", None),  # bucket names have 3 characters at least
    ("s3://Bad_Bucket/x", None),
    ("https://huggingface.co/org/model", None),
    ("gs://bucket/model", None),
]


def source_schema() -> dict:
    crd = yaml.safe_load((REPO / "crds/spyremodels.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["model"]["properties"]["source"]


def crd_accepts(uri: str) -> bool:
    """The CRD's pattern (a full match) and its CEL rules (CEL's `matches` is a search, `!a || b` an
    implication), as an API server that enforces them answers."""
    schema = source_schema()
    if len(uri) > schema["maxLength"] or not re.search(schema["pattern"], uri):
        return False
    for rule in schema["x-kubernetes-validations"]:
        text = " ".join(rule["rule"].split())
        m = re.fullmatch(
            r"!self\.startsWith\('(\w+://)'\) \|\| (!?)self(\.substring\((\d+)\))?\.matches\(r?'(.+)'\)", text
        )
        assert m, f"a rule this test does not read: {text}"
        prefix, negated, start, regex = m[1], m[2] == "!", int(m[4] or 0), m[5]
        if uri.startswith(prefix) and bool(re.search(regex, uri[start:])) == negated:
            return False
    return True


def operator_reads(uri: str) -> dict | None:
    try:
        spec = parse_spec("m", {"model": {"source": uri}, "batching": SHAPES})
    except InvalidSpec as e:
        assert str(e).startswith("spec.model.source: "), e
        return None
    parsed = spec.source.parsed
    assert spec.source.scheme == parsed.scheme and spec.source.uri == uri
    return {k: v for k, v in vars(parsed).items() if v and k != "uri"} | {"path": parsed.path}


def loader_reads(uri: str) -> dict | None:
    try:
        source = parse_source(uri)
    except FetchError as e:
        assert e.exit_code == 2 and f"{uri!r} is not a model source this loader fetches" in str(e)
        return None
    if isinstance(source, HfSource):
        return {"scheme": "hf", "repo": source.repo_id, "revision": source.revision}
    assert isinstance(source, S3Source)
    return {"scheme": "s3", "bucket": source.bucket, "prefix": source.prefix}


@pytest.mark.parametrize(("uri", "parts"), TABLE, ids=[row[0][:60] for row in TABLE])
def test_the_crd_the_operator_and_the_loader_read_a_source_alike(uri, parts):
    assert crd_accepts(uri) == (parts is not None)
    read = operator_reads(uri)
    if parts is None:
        assert read is None
        with pytest.raises(SourceError):
            parse_source_uri(uri)
    else:
        assert {k: read.get(k, "") for k in parts} == parts
    loaded = loader_reads(uri)
    if parts is not None and parts["scheme"] in ("hf", "s3"):
        assert loaded == parts
    else:  # refused by all, or a scheme the pods mount rather than download
        assert loaded is None


def test_the_table_covers_every_scheme_and_each_way_the_readers_disagreed():
    schemes = {parts["scheme"] for _, parts in TABLE if parts}
    assert schemes == {"pvc", "file", "oci", "hf", "s3"}
    refused = {uri for uri, parts in TABLE if parts is None}
    assert {"hf://org/name/", "hf://_org/name", "hf://ibm--granite/model", "s3://bucket"} <= refused
