"""The base of every request schema: strict types, no NaN or infinity, unknown fields refused (a 400 that
names the field, errors.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Strict types, no NaN or infinity, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
