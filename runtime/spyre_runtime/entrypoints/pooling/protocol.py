"""The requests of pooling models as strict schemas: OpenAI's embeddings, vLLM's score, and rerank in vLLM's
/ Jina's / Cohere's format. The checks that need the model (lengths against the warm-up shapes, token ids
inside the vocabulary) are serving.Inputs'."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from spyre_runtime.entrypoints.server.protocol import StrictModel

MAX_INPUTS = 2048  # inputs (or pairs, or documents) in one request, as OpenAI's embeddings API


class PoolingRequest(StrictModel):
    """The fields every pooling request has."""

    model: str | None = Field(default=None, max_length=1024)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = Field(default=None, max_length=1024)


class EmbeddingRequest(PoolingRequest):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    add_special_tokens: bool | None = None


class ScoreRequest(PoolingRequest):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankDocument(StrictModel):
    text: str


class RerankRequest(PoolingRequest):
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool | None = None
