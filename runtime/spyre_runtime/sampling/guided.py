"""Structured output: `response_format` (json_object, json_schema) and vLLM's `guided_json`, `guided_regex`,
`guided_choice`, compiled by llguidance and applied by the sampler as a token mask after the compiled
forward, so no graph is recompiled.

Why llguidance (not outlines-core): it computes each step's mask lazily from the grammar (a lexer plus an
Earley parser over the tokenizer's token trie), so a JSON schema compiles in milliseconds and nothing is
precomputed over the vocabulary; outlines-core builds an index of the whole vocabulary per regex, which
takes seconds or more for large schemas and would stall the engine thread or need a cache. llguidance takes
JSON schemas, regexes and Lark grammars through one API, and vLLM ships it as its `guidance` backend.

    GuideCompiler (one per tokenizer) ─compile(kind, value)─► GuideSpec (a checked grammar; in SamplingParams)
        └─ per request: spec.new_guide() ─► Guide (a matcher: mask for the next token; accept(token))
    GuideCompiler.defer(spec, markers) ─► DeferredGuideSpec: the grammar starts once the output's text holds
        one of `markers` (the end of a model's reasoning, as vLLM applies structured output after it)
"""

from __future__ import annotations

import json
import threading

import torch

_BITS = torch.arange(32, dtype=torch.int32)
DEFER_WINDOW = 32  # tokens decoded to look for the marker that starts a deferred grammar

# JSON comes out as json.dumps writes it: `{"a": 1, "b": [2, 3]}`, no other whitespace. With llguidance's
# default (any run of whitespace between tokens) a small or unsure model can spend all of max_tokens on
# newlines and never close the object (CI saw it: 60 tokens of tabs and newlines, then "length"). A schema
# that wants free whitespace says so itself: `"x-guidance": {"whitespace_flexible": true}` (applied after
# these defaults, as in llguidance and vLLM's guidance backend).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideError(RuntimeError):
    """A grammar could not produce a mask for its row: only that request fails."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(message)
        self.row = row


class GuideSpec:
    """A grammar checked against the tokenizer; each request (and each of its n choices) gets a Guide."""

    def __init__(self, tokenizer, grammar: str, description: str) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.description = description

    def new_guide(self) -> Guide:
        import llguidance

        return Guide(llguidance.LLMatcher(self.tokenizer, self.grammar))

    def __repr__(self) -> str:
        return f"GuideSpec({self.description})"


class Guide:
    """One request's grammar state. `fill` writes the allowed next tokens into a bitmask row; `accept`
    advances by the sampled token. A matcher in error leaves its row unmasked and fails in `accept`, so
    only its request fails."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        if self.matcher.is_error():
            return
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    @property
    def is_complete(self) -> bool:
        """The structure is finished: nothing may follow it."""
        return self.matcher.is_stopped()

    def accept(self, token: int) -> None:
        if self.matcher.is_stopped():
            return
        if self.matcher.is_error() or not self.matcher.consume_token(token):
            raise GuideError(-1, f"structured output failed: {self.matcher.get_error() or 'token rejected'}")


class DeferredGuide:
    """A grammar that starts once the decoded output holds one of `markers`; until then its row is not
    masked and nothing is complete. Only the last DEFER_WINDOW tokens are decoded at each step."""

    def __init__(self, spec: GuideSpec, markers: tuple[str, ...], decode) -> None:
        self.spec, self.markers, self.decode = spec, markers, decode
        self.tokens: list[int] = []
        self.inner: Guide | None = None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.inner is not None:
            self.inner.fill(bitmask, row)

    @property
    def is_complete(self) -> bool:
        return self.inner is not None and self.inner.is_complete

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)
            return
        self.tokens.append(token)
        tail = self.decode(self.tokens[-DEFER_WINDOW:])
        if any(m in tail for m in self.markers):
            self.inner = self.spec.new_guide()


class DeferredGuideSpec:
    def __init__(self, spec: GuideSpec, markers: tuple[str, ...], decode) -> None:
        self.spec, self.markers, self.decode = spec, markers, decode

    def new_guide(self) -> DeferredGuide:
        return DeferredGuide(self.spec, self.markers, self.decode)

    def __repr__(self) -> str:
        return f"DeferredGuideSpec({self.spec.description} after {self.markers})"


def apply_guides(logits: torch.Tensor, rows: list[int], guides: list[Guide]) -> None:
    """In place on logits [B, V]: tokens a row's grammar does not allow next become -inf."""
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    for j, guide in enumerate(guides):
        guide.fill(bitmask, j)
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().view(len(rows), words * 32)[:, :vocab]
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


class GuideCompiler:
    """Builds llguidance's view of the tokenizer on first use, once (about a second for a big vocabulary)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
            return self._tokenizer

    def defer(self, spec: GuideSpec, markers: tuple[str, ...]) -> DeferredGuideSpec:
        """`spec`, started once the output's text holds one of `markers`."""
        return DeferredGuideSpec(spec, markers, self.hf_tokenizer.decode)

    def compile(self, kind: str, value) -> GuideSpec:
        """kind: json_object | json_schema | regex | choice. Raises ValueError for a bad grammar."""
        import llguidance

        try:
            if kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_DEFAULTS
                )
            elif kind == "json_schema":
                schema = json.loads(value) if isinstance(value, str) else value
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(value)
            elif kind == "choice":
                choices = " | ".join(json.dumps(c) for c in value)
                grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {choices}")
            else:
                raise ValueError(f"unknown guide kind {kind!r}")
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"the {kind.replace('_', ' ')} could not be compiled: {e}") from None
        tokenizer = self._ll_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"the {kind.replace('_', ' ')} could not be compiled: {messages[0]}")
        return GuideSpec(tokenizer, grammar, kind)
