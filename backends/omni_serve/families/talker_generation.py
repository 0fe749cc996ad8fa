"""The generation config a talker's vLLM engine reads: its own stop codes, not the thinker's.

Runs in a talker stage's stub, when it builds its engine arguments. A hub omni
checkpoint's generation_config.json (and, without one, its config's eos ids) is the
thinker's, and vLLM adds those eos ids to every request's stop ids. They are text ids,
but a codec code too where the codec vocabulary reaches them (the tiny Qwen2.5-Omni
checkpoint's 2 and 0: its talker stopped on code 2 where transformers' speaks on), and
vLLM's min_tokens holds them back by indexing the logits with them (out of range for a
codec vocabulary smaller than the text one). transformers' talkers stop on their own
codes only: the folder made here holds a generation_config.json with just those.

The folder's path is part of vLLM's compile cache key (ModelConfig.compute_hash hashes
`generation_config`), so it is named by its content: every start of the same talker
finds the compiled model of the last one instead of compiling it again.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def with_talker_stops(args: dict[str, Any], engine_args: dict[str, Any],
                      stop_ids: list[int]) -> dict[str, Any]:
    """`engine_args` with vLLM's `generation_config` set to a folder whose eos ids are the
    talker's `stop_ids`, unless the spec (`args`) names a folder of its own."""
    if args.get("generation_config", "auto") not in ("auto", "vllm") or not stop_ids:
        return engine_args  # "auto" and "vllm" both read the checkpoint's (the thinker's)
    return {**engine_args, "generation_config": talker_generation_config(stop_ids)}


def talker_generation_config(stop_ids: list[int]) -> str:
    """A folder holding a generation_config.json whose eos ids are `stop_ids`, the same
    path for the same ids in every process of this user (written whole, then renamed:
    stubs starting side by side may write it at once)."""
    text = json.dumps({"eos_token_id": [int(i) for i in stop_ids]})
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"omni_talker_generation_{os.getuid()}" / digest
    path = folder / "generation_config.json"
    if not path.exists() or path.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".generation_config.{os.getpid()}.json"
        part.write_text(text)
        os.replace(part, path)
    return str(folder)
