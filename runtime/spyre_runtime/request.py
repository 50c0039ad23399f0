"""One request's state as it moves through the engine. The scheduler reads and moves requests between
queues; only the engine appends tokens and decides when a request is finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from spyre_runtime.sampling.params import SamplingParams, make_generator


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class ImageInput:
    """A request's images as the model's processor made them, and their features once the vision tower
    ran: on the server's worker thread before the request is submitted (entrypoints/chat/images.py), else at
    the request's first prefill step (executor/families/vision.py)."""

    pixel_values: torch.Tensor  # [num_images, tiles, channels, height, width] (tiles padded per image)
    image_sizes: torch.Tensor  # [num_images, 2]: each image's (height, width) before processing
    index: torch.Tensor  # [num_prompt_tokens]: the feature row a prompt position takes, -1 for text
    digest: int  # of the images' pixels: salts the prefix cache's block hashes
    features: torch.Tensor | None = None  # [image tokens, hidden] once the tower ran


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    output_text: str = ""
    scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None  # seeded requests only; others draw from torch's default
    guide: object | None = None  # guided.Guide: the grammar state of structured output
    logprobs: list = field(default_factory=list)  # sampling.TokenLogprob per output token, when asked
    prompt_logprobs: list | None = None  # per prompt token (None for the first), when asked
    error: str | None = None  # why the request failed (finish_reason "error")
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (not EOS)
    num_computed_tokens: int = 0  # continuous batching: tokens whose KV is in the cache
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    state_slot: int = 0  # continuous batching, hybrid models: its Mamba state slot (0: none; state_slots.py)
    images: ImageInput | None = None  # an image-text model's images, placed at its image tokens

    def __post_init__(self) -> None:
        if self.generator is None and self.sampling.seed is not None and not self.sampling.is_greedy:
            self.generator = make_generator(self.sampling.seed)

    @property
    def cache_salt(self) -> int:
        """Salts the prefix cache's block hashes: two prompts share blocks only with the same images."""
        return self.images.digest if self.images is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
