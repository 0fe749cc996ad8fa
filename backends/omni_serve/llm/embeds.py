"""Prompt embeddings for multimodal prompts (runs inside the omni_llm stub, and in tests).

The thinker is a text-architecture model served with vLLM's `prompt_embeds`
input: the prompt's token embeddings, with the rows an encoder stage computed
scattered into the positions of the multimodal placeholder tokens, exactly
as Qwen2.5-Omni's thinker merges image/audio features into `inputs_embeds`.
The embedding table is read from the checkpoint's safetensors, without
loading the rest of the model into this process.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_serve.contract import LLM
from omni_serve.errors import RequestError

_EMBED_SUFFIX = "embed_tokens.weight"


def _embedding_key(model_dir: Path) -> tuple[Path, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for key, file in weight_map.items():
            if key.endswith(_EMBED_SUFFIX) and "visual" not in key and "audio" not in key:
                return model_dir / file, key
        raise FileNotFoundError(f"no *{_EMBED_SUFFIX} in {index}")
    from safetensors import safe_open  # noqa: PLC0415

    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith(_EMBED_SUFFIX):
                    return file, key
    raise FileNotFoundError(f"no *{_EMBED_SUFFIX} in the safetensors files of {model_dir}")


class PromptEmbedder:
    """Token ids + encoder rows -> the prompt_embeds tensor of one request."""

    def __init__(self, weight, placeholder_ids: set[int]):
        self.weight = weight  # torch.Tensor [vocab, hidden]
        self.placeholder_ids = placeholder_ids

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, placeholder_ids: set[int]) -> PromptEmbedder:
        from safetensors import safe_open  # noqa: PLC0415

        file, key = _embedding_key(Path(model_dir))
        with safe_open(str(file), framework="pt") as f:
            weight = f.get_tensor(key)
        return cls(weight, placeholder_ids)

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    def embed(self, token_ids: list[int], mm_embeds: np.ndarray):
        """[len(token_ids), hidden] embeddings; RequestError when rows and placeholders differ."""
        import torch  # noqa: PLC0415

        ids = torch.tensor(token_ids, dtype=torch.long)
        is_slot = torch.tensor([t in self.placeholder_ids for t in token_ids], dtype=torch.bool)
        slots = int(is_slot.sum())
        rows, hidden = mm_embeds.shape
        if hidden != self.hidden_size:
            raise RequestError(LLM.MM_EMBEDS, f"rows must have the model's hidden size "
                                              f"{self.hidden_size}, got {hidden}")
        if rows != slots:
            raise RequestError(LLM.MM_EMBEDS, f"has {rows} rows but the prompt has {slots} "
                                              f"multimodal placeholder tokens; they must be equal")
        out = self.weight[ids].clone()
        out[is_slot] = torch.from_numpy(np.ascontiguousarray(mm_embeds)).to(out.dtype)
        return out
