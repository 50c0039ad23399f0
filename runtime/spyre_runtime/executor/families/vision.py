"""The vision tower of an image-text model, run eagerly on CPU beside the compiled language model.

For `llava_next` (granite-vision) FMS loads one module: a SigLIP tower, a projector, an image newline and a
Granite language model. `split_vision` hands the executor the language model (compiled, warmed, served as any
decoder) and keeps the rest here. The language model of such a model always takes input embeddings (every
step, warm-up included, so its graphs never change): `embed` looks the step's token ids up in the language
model's embedding table and, at the positions of image tokens, puts the image features in their place, as
HF's LlavaNextForConditionalGeneration does before its language model runs. A request's features are
computed once and kept on its `ImageInput`: by the server before it submits the request (entrypoints/
images.py, so no step waits for the tower), else here at its first prefill step; a chunk of a chunked
prefill takes the rows of the features that fall in its positions.
"""

from __future__ import annotations

import logging

import torch

from spyre_runtime.config import ConfigError
from spyre_runtime.executor.step_inputs import TokenSpan
from spyre_runtime.request import ImageInput

log = logging.getLogger(__name__)


class VisionEncoder:
    """The tower, projector and image newline of an FMS LlavaNext (whose language model the executor runs)."""

    def __init__(self, llava: torch.nn.Module) -> None:
        self.llava = llava
        self.image_token_id = int(llava.config.image_token_index)
        self.embedding = llava.language_model.base_model.embedding

    def features(self, images: ImageInput) -> torch.Tensor:
        """[image tokens, hidden]: every image's tiles through the tower and projector, unpadded and packed
        with the image newline (FMS's get_image_features and pack_image_features, HF's order)."""
        dtype = self.embedding.weight.dtype
        with torch.inference_mode():
            tiles = self.llava.get_image_features(images.pixel_values.to(dtype), images.image_sizes)
            packed = self.llava.pack_image_features(tiles, images.image_sizes, self.llava.image_newline)
        expected = int((images.index >= 0).sum())
        if packed.shape[0] != expected:  # the processor and the model disagree: never silently misplace
            raise ValueError(
                f"the vision tower made {packed.shape[0]} image features for {expected} image tokens"
            )
        return packed

    def embed(self, input_ids: torch.Tensor, spans: tuple[TokenSpan, ...] = ()) -> torch.Tensor:
        """[B, L] token ids -> [B, L, hidden] embeddings, image features at the image tokens of `spans`."""
        with torch.inference_mode():
            x = self.embedding(input_ids)
            for span in spans:
                images = span.request.images
                if images is None:
                    continue
                if images.features is None:
                    images.features = self.features(images)
                index = images.index[span.start : span.start + span.length]  # beyond the prompt: no images
                rows = index >= 0
                if bool(rows.any()):
                    cols = span.col + torch.nonzero(rows).flatten()
                    x[span.row, cols] = images.features[index[rows]].to(x.dtype)
        return x


def split_vision(model: torch.nn.Module, tensor_parallel_size: int = 1):
    """(language model, VisionEncoder) of an image-text model; (model, None) for a text-only decoder."""
    if not hasattr(model, "vision_tower") or not hasattr(model, "language_model"):
        return model, None
    if tensor_parallel_size > 1:
        raise ConfigError(
            f"{type(model).__name__} (an image-text model) runs with --tensor-parallel-size 1 only, "
            f"got {tensor_parallel_size}"
        )
    log.info("image-text model: the vision tower runs eagerly on CPU, the language model as configured")
    return model.language_model, VisionEncoder(model)


split_model = split_vision  # the room's hook (families/__init__.py)
