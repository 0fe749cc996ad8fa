"""LoRA adapters chosen per request, as Triton's vllm_backend chooses them.

Runs in the omni_llm stub (the table is read at load, `request()` on the engine loop)
and in unit tests. A model whose engine arguments turn `enable_lora` on names its
adapters in `multi_lora.json` beside those arguments, {adapter name: local folder};
a request picks one with the sampling parameter `lora_name`. An adapter's vLLM id is
its position in that file plus one, so it stays the same for the model's lifetime.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from omni_serve.contract import LLM, MULTI_LORA_FILE
from omni_serve.errors import VerbatimRequestError

# vllm_backend's texts, verbatim: its clients match on them
NOT_ENABLED = "LoRA feature is not enabled."


def _not_supported(name: str, names: list[str]) -> str:
    return f"LoRA {name} is not supported, we currently support {names}"


def lora_enabled(engine_args: dict[str, Any]) -> bool:
    """vllm_backend reads `enable_lora` as a boolean or as the string "true"."""
    return str(engine_args.get("enable_lora", False)).lower() == "true"


@dataclass(frozen=True)
class LoraTable:
    """The adapters a model serves, {name: folder}, in multi_lora.json's order."""

    enabled: bool = False
    adapters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, engine_args: dict[str, Any], directory: str) -> LoraTable:
        """The table of a model whose engine arguments were read from `directory`.

        With `enable_lora` on, `directory`/multi_lora.json must exist and map names to
        adapter folders; a missing or malformed file fails the load, naming it.
        """
        if not lora_enabled(engine_args):
            return cls()
        path = os.path.join(directory, MULTI_LORA_FILE)
        try:
            with open(path) as f:
                adapters = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path}: enable_lora is true in the engine arguments, so this file must map "
                'each LoRA adapter name to its folder, e.g. {"doll": "/weights/loras/doll"}'
            ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from e
        if not isinstance(adapters, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v
                for k, v in adapters.items()):
            raise ValueError(f"{path}: must be a JSON object of adapter name -> folder "
                             f"(non-empty strings), got {str(adapters)[:200]}")
        base = os.path.dirname(os.path.abspath(path))
        return cls(True, {k: v if os.path.isabs(v) else os.path.join(base, v)
                          for k, v in adapters.items()})

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def check(self, name: str | None) -> None:
        """Raise the request's error (vllm_backend's text) unless `name` is None or served."""
        if name is None:
            return
        if not self.enabled:
            raise VerbatimRequestError(LLM.LORA_NAME, NOT_ENABLED)
        if name not in self.adapters:
            raise VerbatimRequestError(LLM.LORA_NAME, _not_supported(name, self.names))

    def request(self, name: str | None):
        """vLLM's LoRARequest for adapter `name` (None for the base model)."""
        self.check(name)
        if name is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=name, lora_int_id=self.names.index(name) + 1,
                           lora_path=self.adapters[name])
