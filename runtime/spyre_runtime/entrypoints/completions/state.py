"""The server state of a decoder model: its engine client (engine/client.py: the engine thread, output
routing, a dead engine, metrics), and what the routes check requests with (the validator, the token text,
an image-text model's image processor)."""

from __future__ import annotations

from fastapi import Request

from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.client import EngineClient
from spyre_runtime.entrypoints.chat.images import ImageLimits, ImagePrompter
from spyre_runtime.entrypoints.completions.formatting import TokenText
from spyre_runtime.entrypoints.completions.submission import Submission
from spyre_runtime.entrypoints.completions.validator import Choice, Limits, Validator
from spyre_runtime.entrypoints.server.state import ServingState
from spyre_runtime.sampling.guided import GuideCompiler


class GenerateState(ServingState):
    def __init__(self, config: RuntimeConfig) -> None:
        super().__init__(config)
        self.client = EngineClient(config, self.metrics)  # before the port is bound: a bad value exits 2
        self.client.on_fatal = lambda: self.on_fatal()
        self.validator: Validator | None = None
        self.token_text: TokenText | None = None
        self.image_limits = ImageLimits.from_env()  # before the port is bound: a bad value exits 2
        self.images: ImagePrompter | None = None  # an image-text model's processor (images.py)

    # runs on a background thread
    def load(self) -> None:
        self.client.loop = self.loop
        self.client.load()
        self.validator = self._validator()
        self.token_text = TokenText(self.client.tokenizer)
        if self.client.vision is not None:
            self.images = ImagePrompter(self.config.model_dir, self.image_limits, self.client.vision)
        self.client.start()

    def _validator(self) -> Validator:
        cfg, client = self.config, self.client
        max_batch = cfg.max_num_seqs if cfg.use_cb else max(s.batch_size for s in cfg.shapes)
        limits = Limits(cfg.served_model_name, client.vocab_size, max_batch)
        guides = GuideCompiler(client.tokenizer, client.model_vocab_size, client.eos_ids)
        return Validator(limits, client.scheduler, guides)

    @property
    def engine_error(self) -> BaseException | None:
        return self.client.error

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self.client.is_alive

    def num_in_flight(self) -> int:
        return len(self.client.streams)

    def in_flight_report(self) -> str:
        return self.client.in_flight_report()

    def warming(self) -> dict | None:
        return self.client.warming()

    def observe_load(self) -> None:
        self.client.observe_load()

    def stop_engine(self) -> None:
        self.client.stop()

    def close(self) -> None:
        self.client.close()

    # ---- admitting requests (event loop) ----------------------------------------------------------

    def ready_validator(self) -> Validator:
        """The request checks, once the server is ready (else a 503)."""
        self.require_ready()
        return self.validator

    def submit(
        self, rid: str, choices: list[Choice], prompts: list[list[int]], images=None, headers=None
    ) -> Submission:
        """`headers`: the HTTP request's, whose `traceparent` the requests' spans continue (tracing.py)."""
        sub = Submission(self.client, rid, choices, prompts, images)
        if self.tracer is not None:
            sub.trace = (self.tracer, self.tracer.context(headers))
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        sub.submit()
        return sub


def generate_state(request: Request) -> GenerateState:
    """The app's state (`app.state.serving`), as a route of this task reads it."""
    return request.app.state.serving
