"""Images of chat requests for an image-text model: OpenAI's `image_url` content parts, decoded, checked
and run through the model's own processor (transformers' AutoProcessor, its PIL image processor), which
tiles each image and expands each image token of the rendered prompt into as many tokens as the image has
features (executor/families/vision.py puts the features there).

Only inline `data:` URLs are accepted: remote URLs are refused (a pod need not reach the internet). A URL
that is not an image, an image of a type other than PNG, JPEG, WebP or GIF, or one above the byte or pixel
limit is a 400 naming `messages.<i>.content.<j>.image_url`, before anything reaches the engine.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from spyre_runtime.config import ConfigError
from spyre_runtime.entrypoints.server.errors import bad_request
from spyre_runtime.request import ImageInput

# the types OpenAI accepts in image_url parts, as PIL names their formats
IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
MAX_BYTES_VAR = "SENDNN_INFERENCE_MAX_IMAGE_BYTES"
MAX_PIXELS_VAR = "SENDNN_INFERENCE_MAX_IMAGE_PIXELS"
MAX_IMAGES_VAR = "SENDNN_INFERENCE_MAX_IMAGES_PER_PROMPT"


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024  # one decoded image (OpenAI's limit)
    max_pixels: int = 4096 * 4096  # width x height of one image
    max_images: int = 4  # per request

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ImageLimits:
        """Read once at start-up; a bad value is a ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        values = {}
        for field, var in (
            ("max_bytes", MAX_BYTES_VAR),
            ("max_pixels", MAX_PIXELS_VAR),
            ("max_images", MAX_IMAGES_VAR),
        ):
            raw = env.get(var, "")
            if raw == "":
                continue
            try:
                values[field] = int(raw)
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is not an integer") from None
            if values[field] < 1:
                raise ConfigError(f"{var}={raw!r} must be at least 1")
        return cls(**values)


def decode_image(url: str, param: str, limits: ImageLimits):
    """A `data:image/<type>;base64,...` URL as an RGB PIL image, or a 400 naming `param`."""
    from PIL import Image

    if url.startswith(("http://", "https://")):
        raise bad_request(
            param,
            "remote image URLs are not fetched (the server need not reach the internet); "
            "send the image inline as a data URL: data:image/png;base64,...",
        )
    if not url.startswith("data:"):
        raise bad_request(param, "must be a data URL: data:image/png;base64,...")
    header, sep, payload = url[5:].partition(",")
    mime, _, encoding = header.partition(";")
    if not sep or encoding != "base64":
        raise bad_request(param, "must be a base64 data URL: data:image/png;base64,...")
    if mime.lower() not in IMAGE_TYPES:
        raise bad_request(param, f"type {mime!r} is not one of {', '.join(IMAGE_TYPES)}")
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise bad_request(param, f"the image is larger than {limits.max_bytes} bytes ({MAX_BYTES_VAR})")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(param, "is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise bad_request(param, f"the image is larger than {limits.max_bytes} bytes ({MAX_BYTES_VAR})")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise bad_request(
            param, f"the image has more than {limits.max_pixels} pixels ({MAX_PIXELS_VAR})"
        ) from None
    except Exception:
        raise bad_request(param, "does not hold a readable PNG, JPEG, WebP or GIF image") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise bad_request(
            param, f"the image has {width}x{height} pixels, more than {limits.max_pixels} ({MAX_PIXELS_VAR})"
        )
    if image.format != IMAGE_TYPES[mime.lower()]:
        raise bad_request(param, f"is declared {mime} but holds a {image.format} image")
    try:
        return image.convert("RGB")
    except Exception as e:  # truncated or corrupt pixel data: the header alone was readable
        raise bad_request(param, f"the image could not be decoded: {e}") from None


class ImagePrompter:
    """The model's processor: a rendered chat prompt and its images -> token ids and the ImageInput; and
    with the executor's VisionEncoder (`encoder`), the vision tower: `encode` computes a request's image
    features on the server's worker thread, before the request reaches the engine, so no engine step waits
    for a tower (granite-vision's takes seconds per 384-pixel tile on CPU) and a tower that fails fails its
    request only. One request's images at a time: several towers at once would only share the cores."""

    def __init__(self, model_dir: Path, limits: ImageLimits, encoder=None) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.limits = limits
        self.encoder = encoder
        self._tower = threading.Lock()

    def encode(self, image_input: ImageInput) -> None:
        if self.encoder is not None:
            with self._tower:
                image_input.features = self.encoder.features(image_input)

    def process(self, text: str, images: list, add_special_tokens: bool) -> tuple[list[int], ImageInput]:
        enc = self.processor(
            images=images, text=text, add_special_tokens=add_special_tokens, return_tensors="pt"
        )
        ids = enc["input_ids"][0].tolist()
        is_image = enc["input_ids"][0] == self.processor.image_token_id
        index = torch.where(is_image, torch.cumsum(is_image.long(), 0) - 1, -1)
        pixels = enc["pixel_values"]
        digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=8)
        digest.update(enc["image_sizes"].numpy().tobytes())
        return ids, ImageInput(pixels, enc["image_sizes"], index, int.from_bytes(digest.digest(), "big"))
