"""moto's S3 server with one behaviour of AWS it lacks: an object encrypted with SSE-KMS has an ETag that is
not the MD5 of its data (AWS documents that only SSE-S3 and unencrypted objects have MD5 ETags). Run as a
script by S3Server, with moto.server's arguments. Test infrastructure, never shipped."""

from __future__ import annotations

import hashlib
import sys

from moto.s3.models import FakeKey
from moto.server import main

_md5_etag = FakeKey.etag


def _etag(self: FakeKey) -> str:
    etag = _md5_etag.fget(self)
    if self.encryption not in ("aws:kms", "aws:kms:dsse"):
        return etag
    digest, dash, parts = etag.strip('"').partition("-")
    opaque = hashlib.md5(f"sse-kms:{digest}".encode(), usedforsecurity=False).hexdigest()
    return f'"{opaque}{dash}{parts}"'


FakeKey.etag = property(_etag)

if __name__ == "__main__":
    main(sys.argv[1:])
