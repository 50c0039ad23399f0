"""A seeded random tiny vision-language model of granite-vision-3.3-2B's architecture
(`LlavaNextForConditionalGeneration`: a SigLIP vision tower, a two-layer projector over several of its
layers' features, anyres tiling with an image newline, and a Granite language model), saved with its image
processor (the PIL one: no torchvision), a tokenizer holding `<image>` and a chat template that places the
image token as granite-vision's does (a user turn's images first, each `<image>` on its own line, then its
text), so transformers' AutoProcessor loads the folder offline."""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_TOKEN = "<image>"
VISION_SPECIAL_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end_of_text|>", IMAGE_TOKEN]
TILE = 32  # the tower's image size: the processor tiles an image into TILE x TILE crops
PATCH = 8
GRID_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]

# granite-vision-3.3-2B's template, in its shape: a default system turn, a user turn's images first (one
# `<image>` line each), then its text parts, each ending its line; content may also be a plain string
GRANITE_VISION_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] if messages[0]['content'] is string else"
    " (messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join) -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = 'A chat between a curious user and an artificial intelligence assistant.' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{{ '<|system|>\n' + system + '\n' }}"
    "{%- for message in loop_messages -%}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] + '\n' }}"
    "{%- else -%}"
    "{%- for part in message['content'] | selectattr('type', 'equalto', 'image') -%}{{ '<image>\n' }}"
    "{%- endfor -%}"
    "{%- for part in message['content'] | selectattr('type', 'equalto', 'text') -%}{{ part['text'] + '\n' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '<|end_of_text|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)


def write_tiny_vision_model(
    out_dir: str | Path, tokenizer, seed: int = 0, hidden: int = 64, num_layers: int = 2
) -> Path:
    """Writes the folder (same seed -> same bytes): config.json, model.safetensors, the tokenizer (models.py's
    tiny one, given, with the chat's special tokens added), the image processor and processor configs,
    chat_template.jinja."""
    import torch
    from transformers import (
        GraniteConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        SiglipVisionConfig,
    )

    tokenizer.add_special_tokens({"additional_special_tokens": VISION_SPECIAL_TOKENS})
    tokenizer.eos_token = "<|end_of_text|>"
    tokenizer.chat_template = GRANITE_VISION_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = GraniteConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # as granite-vision
        initializer_range=0.25,  # decisive greedy choices (see models.write_tiny_model)
        embedding_multiplier=2.0,
        logits_scaling=1.5,
        residual_multiplier=0.5,
        attention_multiplier=0.125,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
    )
    config = LlavaNextConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_index=image_token_id,
        image_grid_pinpoints=GRID_PINPOINTS,
        vision_feature_layer=[-2, -1],  # granite-vision concatenates several layers' features
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # HF leaves the projector and the newline at their init; spread them as weights
        for p in (*model.model.multi_modal_projector.parameters(), model.model.image_newline):
            p.normal_(0.0, 0.25)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _write_processor(out, tokenizer)
    _hub_tower_names(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["LlavaNextForConditionalGeneration"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _write_processor(out: Path, tokenizer) -> None:
    """The processor granite-vision ships (anyres tiling over the grid pinpoints, SigLIP's normalization),
    with transformers' PIL image processor, which needs no torchvision."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": TILE},
        crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=GRID_PINPOINTS,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="full",
        chat_template=GRANITE_VISION_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(out)


def _hub_tower_names(path: Path) -> None:
    """The tower's weights under the names granite-vision's checkpoint uses (`vision_tower.vision_model.`,
    which FMS's adapter reads; transformers 5 saves them without `vision_model.` and reads both)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    prefix = "vision_tower."
    renamed = {
        (prefix + "vision_model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in state.items()
    }
    save_file(renamed, str(path), metadata={"format": "pt"})
