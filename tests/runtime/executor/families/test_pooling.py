"""Pooling models without a server: the scheduler (pure), what a folder is, and parity of our FMS
encoders with sentence-transformers (all-MiniLM-L6-v2) and HF's forward (tiny cross-encoders).

Parity tolerance: float32 everywhere; every embedding within 1e-5 (max abs difference per coordinate) of
sentence-transformers', every cross-encoder score within 1e-5 of sigmoid(HF logits). Measured: about
2e-7 (MiniLM, eager and inductor) and below 2e-7 (cross-encoders)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from spyre_contract import ContractError, Shape
from spyre_runtime.config import RuntimeConfig
from spyre_runtime.engine.sched.pooling import PoolingScheduler, PoolItem
from spyre_runtime.executor.families.pooling import PoolingModel, detect_pooling, detect_task
from spyre_runtime.testing.models import prepare_minilm, write_tiny_cross_encoder

TOLERANCE = 1e-5
TEXTS = [
    "The capital of France is Paris.",
    "hello world",
    "Kubernetes reconciles custom resources into pods, services and volumes; operators watch and react.",
    "a",
    "Large language models run on accelerator cards; a scheduler batches requests and a compiler warms "
    "shapes so that nothing compiles while serving. " * 3,
    "What is the answer? It is forty-two.",
]


def item(n: int) -> PoolItem:
    return PoolItem(list(range(1, n + 1)), None, lambda out: None)


# ---- the scheduler --------------------------------------------------------------------------------

SHAPES = (Shape(64, 0, 8), Shape(128, 0, 4), Shape(256, 0, 1))


def test_one_short_input_runs_at_the_smallest_shape():
    s = PoolingScheduler(SHAPES)
    s.add(item(10))
    step = s.schedule()
    assert step.shape == Shape(64, 0, 8) and len(step.items) == 1 and s.num_waiting == 0
    assert s.schedule() is None


def test_inputs_of_many_requests_share_a_step_up_to_the_batch_size():
    s = PoolingScheduler(SHAPES)
    items = [item(20) for _ in range(11)]
    for i in items:
        s.add(i)
    first, second = s.schedule(), s.schedule()
    assert first.items == tuple(items[:8]) and first.shape == Shape(64, 0, 8) and first.occupancy == 1.0
    assert second.items == tuple(items[8:]) and second.shape == Shape(64, 0, 8)


def test_a_longer_input_moves_the_step_to_a_longer_shape_that_holds_everyone():
    s = PoolingScheduler(SHAPES)
    short, longer = [item(30) for _ in range(3)], item(100)
    for i in [*short, longer]:
        s.add(i)
    step = s.schedule()
    assert step.shape == Shape(128, 0, 4) and step.items == (*short, longer)


def test_the_oldest_input_always_runs_first_and_later_ones_wait_in_order():
    s = PoolingScheduler(SHAPES)
    oldest, short1, short2 = item(200), item(10), item(10)
    for i in (oldest, short1, short2):
        s.add(i)
    first = s.schedule()
    assert first.items == (oldest,) and first.shape == Shape(256, 0, 1)
    assert s.schedule().items == (short1, short2)


def test_an_input_that_does_not_fit_the_batch_is_skipped_not_dropped():
    s = PoolingScheduler(SHAPES)
    a = [item(100) for _ in range(4)]
    b = item(10)
    late_long = item(120)
    for i in [*a, late_long, b]:
        s.add(i)
    step = s.schedule()  # 4 x 100 fill (128, 4); the fifth long one and the short one wait, in order
    assert step.items == tuple(a) and step.shape == Shape(128, 0, 4)
    assert s.schedule().items == (late_long, b)


def test_cancelled_inputs_are_dropped_and_oversized_ones_refused():
    s = PoolingScheduler(SHAPES)
    gone, kept = item(10), item(10)
    gone.is_cancelled = True
    s.add(gone)
    s.add(kept)
    assert s.schedule().items == (kept,)
    with pytest.raises(ValueError, match="257 tokens fits no shape"):
        s.add(item(257))
    assert not s.can_fit(0) and s.can_fit(256)


# ---- what a folder is -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def minilm() -> Path:
    return prepare_minilm(Path.home() / ".cache/spyre-serve/models/minilm")


@pytest.fixture(scope="session")
def cross_encoders(tmp_path_factory) -> dict[str, Path]:
    return {
        f: write_tiny_cross_encoder(tmp_path_factory.mktemp(f"ce-{f}"), f, seed=1)
        for f in ("bert", "roberta")
    }


def test_minilm_folder_is_a_mean_pooled_normalized_embedding_model(minilm):
    assert detect_task(minilm) == "embed"
    spec = detect_pooling(minilm)
    assert (spec.architecture, spec.family, spec.is_cross_encoder) == ("BertModel", "bert", False)
    assert (spec.pooling, spec.normalize, spec.max_len, spec.hidden_size) == ("mean", True, 256, 384)


def test_cross_encoder_folders_score(cross_encoders):
    for family, folder in cross_encoders.items():
        assert detect_task(folder) == "score"
        spec = detect_pooling(folder, "rerank")
        assert spec.is_cross_encoder and spec.family == family and spec.sigmoid
        with pytest.raises(ContractError, match=r"--task=embed: .* is a cross-encoder"):
            detect_pooling(folder, "embed")


def _st_folder(tmp_path: Path, minilm: Path, modules: list[dict], pooling: dict) -> Path:
    folder = tmp_path / "st"
    folder.mkdir()
    shutil.copy(minilm / "config.json", folder / "config.json")
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


def test_sentence_transformers_modules_decide_pooling_and_normalization(tmp_path, minilm):
    transformer = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    folder = _st_folder(tmp_path, minilm, [transformer, pooling], {"pooling_mode_cls_token": True})
    spec = detect_pooling(folder)
    assert (spec.pooling, spec.normalize) == ("cls", False)  # no Normalize module: raw vectors
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ContractError, match="exactly one of mean, cls, max or last-token pooling"):
        detect_pooling(folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (folder / "modules.json").write_text(json.dumps([transformer, pooling, dense]))
    with pytest.raises(ContractError, match="module Dense is not supported"):
        detect_pooling(folder)


def test_decoders_and_unknown_encoders(tmp_path, tiny_model):
    assert detect_task(tiny_model) == "generate"
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "t5", "architectures": ["T5EncoderModel"]})
    )
    (tmp_path / "modules.json").write_text("[]")
    assert detect_task(tmp_path) == "embed"
    with pytest.raises(ContractError, match="need a bert or roberta encoder"):
        detect_pooling(tmp_path)


# ---- parity ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_embeddings(minilm):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm), device="cpu")
    return st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))


def _rows(tokenizer, texts, pairs=None, types=True):
    enc = tokenizer(texts, pairs)
    tt = enc.get("token_type_ids") if types else None
    return [(ids, tt[i] if tt else None) for i, ids in enumerate(enc["input_ids"])]


@pytest.mark.parametrize(
    ("backend", "shapes"),
    [
        ("eager", (Shape(64, 0, 1), Shape(64, 0, 8), Shape(128, 0, 2))),
        ("inductor", (Shape(64, 0, 4), Shape(128, 0, 2))),
    ],
)
def test_minilm_embeddings_equal_sentence_transformers(minilm, reference_embeddings, backend, shapes):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm)
    config = RuntimeConfig(model_dir=minilm, served_model_name="m", backend=backend, shapes=shapes)
    model = PoolingModel(config, detect_pooling(minilm), tok.pad_token_id)
    model.warmup()
    assert model.progress.snapshot() == {"done": len(shapes), "total": len(shapes)}
    rows = _rows(tok, TEXTS)
    for shape in shapes:
        fitting = [i for i, (ids, _) in enumerate(rows) if len(ids) <= shape.prompt_len]
        for start in range(0, len(fitting), shape.batch_size):
            chunk = fitting[start : start + shape.batch_size]
            ours = model.run(shape, [rows[i] for i in chunk])
            assert ours.shape == (len(chunk), 384)
            diff = (ours - reference_embeddings[chunk]).abs().max().item()
            assert diff < TOLERANCE, f"{backend} {shape}: max abs difference {diff}"
    assert torch.allclose(model.run(shapes[-1], rows[:1])[0].norm(), torch.tensor(1.0), atol=1e-5)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_cross_encoder_scores_and_order_equal_hf(cross_encoders, family):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = cross_encoders[family]
    tok = AutoTokenizer.from_pretrained(folder)
    query = "what is the capital of france"
    docs = [t.lower() for t in TEXTS]
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(hf(**batch).logits[:, 0])
    spec = detect_pooling(folder)
    shape = Shape(256, 0, 8)
    config = RuntimeConfig(model_dir=folder, served_model_name="ce", backend="eager", shapes=(shape,))
    model = PoolingModel(config, spec, tok.pad_token_id)
    ours = model.run(shape, _rows(tok, [query] * len(docs), docs, types=family == "bert"))
    assert (ours - expected).abs().max().item() < TOLERANCE
    assert torch.argsort(ours, descending=True).tolist() == torch.argsort(expected, descending=True).tolist()
    assert len(set(ours.tolist())) == len(docs)  # distinct scores: the ordering is meaningful


def test_shapes_longer_than_the_model_accepts_are_refused(minilm):
    config = RuntimeConfig(
        model_dir=minilm, served_model_name="m", backend="eager", shapes=(Shape(512, 0, 1),)
    )
    with pytest.raises(ContractError, match="512 is longer than the 256 tokens"):
        PoolingModel(config, detect_pooling(minilm), 0)


def test_serve_refuses_shapes_longer_than_the_model_before_binding(minilm):
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "512",
    }
    argv = [sys.executable, "-m", "spyre_runtime.cli", "serve", str(minilm), "--port", "17998"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "spyre-runtime: error: SENDNN_INFERENCE_WARMUP_PROMPT_LENS: 512 is longer than the 256 tokens "
        "minilm accepts"
    )


def test_graph_cache_compile_once_then_load_and_strict_mode(cross_encoders, tmp_path):
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor",
        "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "64",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
        "TORCH_SENDNN_CACHE_ENABLE": "1",
        "TORCH_SENDNN_CACHE_DIR": str(tmp_path / "cache"),
    }
    argv = [sys.executable, "-m", "spyre_runtime.cli", "compile", str(cross_encoders["bert"])]

    def compile_once() -> dict:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = compile_once(), compile_once()
    assert cold["cache"] == "miss" and cold["graphs_compiled"] >= 1
    assert warm["cache"] == "hit" and warm["graphs_compiled"] == 0 and warm["key"] == cold["key"]
    strict = {
        **env,
        "SENDNN_INFERENCE_REQUIRE_PRECOMPILED_DECODERS": "1",
        "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "4",
    }
    serve = [
        sys.executable,
        "-m",
        "spyre_runtime.cli",
        "serve",
        str(cross_encoders["bert"]),
        "--port",
        "17997",
    ]
    done = subprocess.run(serve, env=strict, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "has no entry for key inductor-" in done.stderr.strip().splitlines()[-1]
