"""An image-text model (llava_next, granite-vision's architecture) served end to end: chat messages with
image_url parts through the real server and the official openai client give the greedy tokens of HF
transformers' LlavaNextForConditionalGeneration.generate on the same weights and images, with static and
continuous batching (chunked prefill, prefix caching on), eager and inductor; bad images are 400s naming
the part, and the engine stays up; a text-only model refuses image parts. In the engine alone: mixed steps
(pieces of several prompts beside decode rows) place each piece's features."""

import asyncio
import base64
import io
import os
import subprocess
import sys

import numpy as np
import openai
import pytest
from PIL import Image
from spyre_runtime.config import ConfigError, RuntimeConfig
from spyre_runtime.engine.llm_engine import LLMEngine
from spyre_runtime.entrypoints.chat.images import ImageLimits, ImagePrompter
from spyre_runtime.entrypoints.chat.prompts import chat_prompt
from spyre_runtime.entrypoints.completions.protocol import ChatCompletionRequest
from spyre_runtime.entrypoints.server.errors import APIError
from spyre_runtime.sampling.params import SamplingParams
from spyre_runtime.testing.models import build_tokenizer, write_tiny_model

from tests.runtime.serverproc import ServerProcess

MAX_TOKENS = 8
STATIC = {
    "SENDNN_INFERENCE_WARMUP_PROMPT_LENS": "256",
    "SENDNN_INFERENCE_WARMUP_NEW_TOKENS": "16",
    "SENDNN_INFERENCE_WARMUP_BATCH_SIZES": "2",
}
CONTINUOUS = {"SENDNN_INFERENCE_USE_CB": "1"}
CB_ARGS = ("--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "64")
LIMITS = {"SENDNN_INFERENCE_MAX_IMAGE_PIXELS": "4000000"}
MODES = {
    "static-eager": ({**STATIC, **LIMITS, "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"}, ()),
    "continuous-eager": ({**CONTINUOUS, **LIMITS, "SENDNN_INFERENCE_DYNAMO_BACKEND": "eager"}, CB_ARGS),
    "static-inductor": ({**STATIC, **LIMITS, "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor"}, ()),
    "continuous-inductor": ({**CONTINUOUS, **LIMITS, "SENDNN_INFERENCE_DYNAMO_BACKEND": "inductor"}, CB_ARGS),
}


def image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def data_url(img: Image.Image, fmt: str = "PNG", mime: str = "image/png") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


# (question, images): two prompts differ only in their image (the prefix cache must tell them apart), one
# has two images, one is long enough that its image tokens cross chunk boundaries
CHATS = [
    ("What is the capital of France?", [image(0, 40, 70)]),
    ("What is the capital of France?", [image(1, 40, 70)]),
    ("Compare them.", [image(2, 64, 30), image(3, 50, 50)]),
    ("hello " * 8, [image(4, 90, 33)]),
]


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llava-next"), arch="llava_next", seed=0)


@pytest.fixture(scope="module")
def references(vision_model):
    """HF transformers' greedy tokens for each chat (EOS does not stop it, as ignore_eos)."""
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    processor = AutoProcessor.from_pretrained(vision_model)
    model = LlavaNextForConditionalGeneration.from_pretrained(vision_model).eval()
    model.generation_config.eos_token_id = None
    out = []
    for text, images in CHATS:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True
        )
        enc = processor(images=images, text=prompt, add_special_tokens=False, return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        out.append(ids[0, enc["input_ids"].shape[1] :].tolist())
    return out


def test_mixed_steps_give_each_piece_its_features(vision_model, references):
    """In the engine (no server): prompts arrive while others decode, so mixed steps carry pieces of
    several prompts beside decode rows, each piece taking the features of its own positions; features
    computed before submitting (the server's way) or at the first prefill step give the same tokens."""
    config = RuntimeConfig(
        model_dir=vision_model,
        served_model_name="t",
        backend="eager",
        use_cb=True,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    engine = LLMEngine(config)
    prompter = ImagePrompter(vision_model, ImageLimits(), encoder=engine.executor.vision)
    steps = []
    engine.on_step = lambda step, _: steps.append(step)
    reqs = []
    for k, (text, images) in enumerate(CHATS):
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = prompter.processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True
        )
        ids, image_input = prompter.process(prompt, images, add_special_tokens=False)
        assert int((image_input.index >= 0).sum()) == ids.count(prompter.processor.image_token_id)
        if k % 2:  # as the server does: the tower runs before submitting; else at the first prefill step
            prompter.encode(image_input)
            assert image_input.features.shape[0] == ids.count(prompter.processor.image_token_id)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        reqs.append(engine.add_request(ids, params, images=image_input))
        for _ in range(2 * k + 1):  # the next prompt arrives while these decode
            engine.step()
    while engine.has_work():
        engine.step()
    assert any(step.mixed for step in steps)
    assert [r.output_token_ids for r in reqs] == references


@pytest.fixture(scope="module", params=list(MODES))
def server(request, vision_model, tmp_path_factory):
    env, args = MODES[request.param]
    log = tmp_path_factory.mktemp(f"vision-{request.param}") / "server.log"
    with ServerProcess(vision_model, env, log, extra_args=args).serving() as srv:
        yield srv


def chat_tokens(client, text: str, urls: list[str]) -> list[int]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    return [int(t.token.removeprefix("token_id:")) for t in resp.choices[0].logprobs.content]


async def _concurrently(server, chats):
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(text, images):
        parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
        resp = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        return [int(t.token.removeprefix("token_id:")) for t in resp.choices[0].logprobs.content]

    return await asyncio.gather(*(one(text, images) for text, images in chats))


def test_greedy_tokens_equal_hf_generate(server, references):
    client = server.client(timeout=120)
    alone = [chat_tokens(client, text, [data_url(i) for i in images]) for text, images in CHATS]
    assert alone == references
    # again, batched together: the second pass hits the prefix cache (continuous batching) for the same
    # image, and must not for the other image of the same text
    assert asyncio.run(_concurrently(server, CHATS)) == references
    assert references[0] != references[1]  # the image, not only the text, decides the answer


def test_streamed_answer_is_the_whole_answer(server):
    text, images = CHATS[2]
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    client = server.client(timeout=120)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and whole


def _bad_cases():
    png = data_url(image(5, 20, 20))
    payload = png.split(",", 1)[1]
    return [
        ("remote", "https://example.com/cat.png", "remote image URLs are not fetched"),
        ("not a data url", "file:///etc/passwd", "must be a data URL"),
        ("not base64", "data:image/png;base64,@@not-base64@@", "is not valid base64"),
        ("not an image", "data:image/png;base64," + base64.b64encode(b"hello world").decode(), "readable"),
        ("wrong type", "data:text/plain;base64," + payload, "is not one of image/png"),
        ("mislabelled", "data:image/jpeg;base64," + payload, "declared image/jpeg but holds a PNG"),
        ("too many pixels", data_url(Image.new("RGB", (2100, 2100))), "more than 4000000"),
        ("no url", None, "needs a url"),
    ]


@pytest.mark.parametrize("server", ["continuous-eager"], indirect=True)  # one server is enough
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_image_is_a_400_naming_the_part(server, case):
    _, url, expected = case
    client = server.client()
    image_url = {"url": url} if url is not None else {}
    parts = [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": image_url}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2
        )
    body = err.value.body
    assert body["param"] == "messages.0.content.1.image_url"
    assert expected in body["message"]
    # the engine stays up: a good request right after is answered
    assert chat_tokens(client, CHATS[0][0], [data_url(i) for i in CHATS[0][1]])


@pytest.mark.parametrize("server", ["continuous-eager"], indirect=True)
def test_more_images_than_allowed_is_a_400(server):
    url = data_url(image(7, 16, 16))
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 5 + [{"type": "text", "text": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2
        )
    assert err.value.body["param"] == "messages.0.content.4.image_url"
    assert "at most 4 images per request" in err.value.body["message"]


def test_text_only_model_refuses_image_parts():
    body = ChatCompletionRequest(
        model="t",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": data_url(image(0, 8, 8))}}],
            }
        ],
    )
    with pytest.raises(APIError) as err:
        asyncio.run(chat_prompt(build_tokenizer(), body, prompter=None))
    assert err.value.status == 400
    assert err.value.param == "messages.0.content.0"
    assert "images need an image-text model" in err.value.message


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ImageLimits()),
        ({"SENDNN_INFERENCE_MAX_IMAGE_BYTES": "1000"}, ImageLimits(max_bytes=1000)),
        (
            {"SENDNN_INFERENCE_MAX_IMAGES_PER_PROMPT": "1", "SENDNN_INFERENCE_MAX_IMAGE_PIXELS": ""},
            ImageLimits(max_images=1),
        ),
        (
            {"SENDNN_INFERENCE_MAX_IMAGE_PIXELS": "lots"},
            "SENDNN_INFERENCE_MAX_IMAGE_PIXELS='lots' is not an integer",
        ),
        (
            {"SENDNN_INFERENCE_MAX_IMAGES_PER_PROMPT": "0"},
            "SENDNN_INFERENCE_MAX_IMAGES_PER_PROMPT='0' must be at least 1",
        ),
    ],
)
def test_image_limits_from_the_environment(env, expected):
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            ImageLimits.from_env(env)
    else:
        assert ImageLimits.from_env(env) == expected


def test_a_bad_image_limit_stops_serve_in_one_line(vision_model):
    env = {"SENDNN_INFERENCE_DYNAMO_BACKEND": "eager", "SENDNN_INFERENCE_MAX_IMAGE_BYTES": "-5"}
    proc = subprocess.run(
        [sys.executable, "-m", "spyre_runtime.cli", "serve", str(vision_model), "--port", "1"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "spyre-runtime: error: SENDNN_INFERENCE_MAX_IMAGE_BYTES='-5' must be at least 1"
    )
