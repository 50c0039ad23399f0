"""One room per model family: what is specific to a family, beside the general machinery of executor/.

The registry (spyre_contract/architectures.py, `ARCHITECTURES`) declares, per architecture, what it supports
and its room; rooms.py looks the model up there and calls the room's hooks (each optional):

    fms_overrides(hf_config) -> dict          what FMS's param builders miss (qwen3.py, granite4.py)
    load_model(config) -> module | None       the family loads itself (hybrid/, granite4.py's hybrid form)
    split_model(model, tp) -> (lm, encoder)   an image-text model's vision tower apart (vision.py)
    attach_state(model, config, dtype)        per-sequence state beside the KV cache (hybrid/)

Beside them: fp8.py (FP8 checkpoints of any family, dequantized at load) and pooling.py (the encoders of
embedding models and cross-encoders, with their own executor).
"""
