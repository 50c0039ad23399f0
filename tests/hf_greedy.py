"""The answer a served tiny model must give: HF transformers' greedy continuation of the same weights, decoded
as the runtime decodes it (special tokens skipped). Tests that ask a server compare its text with this, so an
answer that exists but says the wrong thing fails."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(model_dir), model


def hf_greedy_text(model_dir: str | Path, prompt: str | list[int], max_tokens: int) -> str:
    """The text of HF's greedy `max_tokens` (stopping at EOS, as the server does) after `prompt`."""
    import torch

    tokenizer, model = _model(str(model_dir))
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
