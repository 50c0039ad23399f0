"""Offline batch inference: `LLM(model_dir).generate(prompts, SamplingParams(...))`, the engine built as the
server builds it (builder.build_engine) and stepped synchronously until every request finished."""

from __future__ import annotations

from pathlib import Path

from spyre_runtime.config import RuntimeConfig, load_config
from spyre_runtime.engine.builder import build_engine
from spyre_runtime.engine.outputs import RequestOutput
from spyre_runtime.sampling.params import SamplingParams


class LLM:
    """Offline batch inference: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

    def __init__(
        self, model_dir: str | Path, warmup: bool = True, config: RuntimeConfig | None = None, **overrides
    ) -> None:
        """`overrides` are load_config's arguments (`environ=`, flags); or pass a ready `config`."""
        if config is None:
            environ = overrides.pop("environ", None)
            config = load_config(model_dir, environ=environ, **overrides)
        self.config = config
        built = build_engine(config, warmup=warmup)
        self.engine = built.engine
        self.warmup = built.warmup

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the tensor-parallel ranks, if any."""
        self.engine.close()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One SamplingParams for all prompts, or one per prompt. Runs until every request finished."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [p if isinstance(p, list) else self.tokenizer(p)["input_ids"] for p in prompts]
        order = [self.engine.add_request(p, sp).request_id for p, sp in zip(ids, per_prompt, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in order]
