"""Tensors read from a checkpoint folder as the hub ships it (runs in a stage's Triton Python stub, at load).

The families' stage code (encoders, talker prompts, Token2Wav, Code2Wav) reads
its part of the checkpoint through these functions when the stage's model
loads. What flows through: the folder's `model.safetensors.index.json` (its
`weight_map` names the shard of each tensor) or, without one, the headers of
its safetensors files; then only the wanted tensors (or rows of one), each
shard opened once with safetensors' `safe_open`. Tensors come back on CPU in
their checkpoint dtype (rows as float32); nothing else of the folder is read.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _weight_map(folder: Path) -> dict[str, Path] | None:
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}


def tensor_files(folder: Path, pattern: str = "*.safetensors") -> dict[str, Path]:
    """{tensor name: safetensors file}: the index's weight_map, else the headers of the folder's
    files matching `pattern` (in name order; no tensor is read). Empty when there are none."""
    files = _weight_map(folder)
    if files is not None:
        return files
    from safetensors import safe_open

    files = {}
    for path in sorted(folder.glob(pattern)):
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def shards(folder: Path, names: Iterable[str]) -> dict[str, Path]:
    """{name: its shard} without reading a header: the index's (KeyError for a name it does
    not list), else model.safetensors (which need not exist yet: reading it then fails)."""
    files = _weight_map(folder)
    return {name: files[name] if files is not None else folder / SINGLE_FILE for name in names}


def read_tensors(files: Mapping[str, Path], names: Iterable[str], strip: str = "") -> dict[str, torch.Tensor]:
    """The tensors `names` (their files from `files`), keyed by name less the leading `strip`;
    each file is opened once and only these tensors read."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for path, in_file in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in in_file:
                out[name.removeprefix(strip)] = f.get_tensor(name)
    return out


def read_prefixed(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The `prefix*` tensors of a hub folder (the index's shards that hold them, else
    model.safetensors), prefix stripped; empty when it has none."""
    if not (folder / INDEX_FILE).is_file() and not (folder / SINGLE_FILE).is_file():
        raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    files = tensor_files(folder, SINGLE_FILE)
    return read_tensors(files, [name for name in files if name.startswith(prefix)], strip=prefix)


def read_rows(folder: Path, name: str, ids: list[int]) -> np.ndarray:
    """Rows `ids` of the checkpoint tensor `name`, as float32 (reads only those rows)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(shards(folder, [name])[name]), framework="pt") as f:
        part = f.get_slice(name)
        return torch.stack([part[i:i + 1][0] for i in ids]).float().numpy()
