"""Sampling parameters: what a request asks of the sampler, checked once, and the per-token logprob record."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

GREEDY_EPSILON = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = (
    1e-2  # temperatures in (GREEDY_EPSILON, MIN_TEMPERATURE) are raised to it (vLLM's _MAX_TEMP)
)
MAX_LOGPROBS = 20  # top logprobs per token, as vLLM's default max_logprobs
TOP_P_CANDIDATES = 256  # top_p looks at this many top tokens first; bisection only when they do not suffice
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. Checked here too (ValueError), so offline callers get the same rules
    as the HTTP API. `eos_token_ids` is filled by the engine (banned while min_tokens is not reached)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the top k
    guide: object | None = field(default=None, compare=False)  # a guided.GuideSpec
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(
                self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items())
            )
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(self.top_k >= -1, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        rp = self.repetition_penalty
        _check(_finite(rp) and 0 < rp <= 10, "repetition_penalty", f"must be in (0, 10], got {rp}")
        for _, bias in self.logit_bias:
            _check(_finite(bias) and -100 <= bias <= 100, "logit_bias", "values must be in [-100, 100]")
        _check(
            self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
            "seed",
            "must fit in a signed 64-bit integer",
        )
        _check(all(self.stop), "stop", "stop strings must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"must be between 0 and {MAX_LOGPROBS}")
        if self.temperature < GREEDY_EPSILON:
            object.__setattr__(self, "temperature", 0.0)
        elif self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)  # smaller ones overflow the softmax

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class SamplingParamError(ValueError):
    """A sampling parameter out of range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def make_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed % 2**64)  # torch takes 0 .. 2**64-1; negative int64 seeds wrap
    return generator


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one chosen token, its rank (1 = most likely) and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
