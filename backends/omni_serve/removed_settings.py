"""A stage config that refuses settings which are gone or renamed (any process).

A stage's engine.json (and omni-gen-repo's spec check, which reads the same table)
gets one error naming each old key and what to do instead, rather than pydantic's
generic "extra inputs are not permitted".
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, model_validator


class RefusesRemovedSettings(BaseModel):
    # old key -> what to do instead (docs/glossary.md for renames)
    REMOVED_SETTINGS: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_removed_settings(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            gone = [f"{key}: {cls.REMOVED_SETTINGS[key]}" for key in data
                    if key in cls.REMOVED_SETTINGS]
            if gone:
                raise ValueError("; ".join(gone))
        return data
