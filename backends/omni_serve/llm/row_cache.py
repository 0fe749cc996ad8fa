"""Hidden-state rows of prefix-cached positions, kept where the engine computed them.

Runs in vLLM's worker process, beside the capture (llm/hidden_states.py). vLLM's
prefix cache skips the positions of a prompt's cached blocks, so a capturing request
(a spoken reply: its talker reads a row per prompt position) that hits it gets no rows
for them from the model. This cache keeps, per block of `block_size` positions, the rows
a capturing request computed, keyed as vLLM keys its KV blocks: a hash chain over the
block's token ids, the identity and placement of the media items that overlap it, and
the LoRA adapter. A later request whose first N positions hit vLLM's cache gets those
N rows from here, written before the positions it computes, so a reader never sees a
hole. When a block is missing (evicted here, or computed by a request that did not
capture, e.g. a text reply) the request is marked missed and the stage recomputes it
without reading the prefix cache (llm/stage.py).

What flows through it: [embedding | hidden] float32 rows in, the same rows out; the
least recently used blocks go first once `budget_bytes` is exceeded.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from omni_serve import env


def budget_bytes() -> int:
    """The cache's size from the environment (0 turns it off: capturing requests then
    skip the prefix cache)."""
    try:
        mb = float(env.HIDDEN_ROWS_CACHE_MB.get() or 0)
    except ValueError:
        raise ValueError(f"{env.HIDDEN_ROWS_CACHE_MB.name} must be a number of MiB, got "
                         f"{env.HIDDEN_ROWS_CACHE_MB.get()!r}") from None
    return max(0, int(mb * 2**20))


def block_keys(tokens: Sequence[int], media: Sequence[tuple[str, int, int]], block_size: int,
               blocks: int, salt: str = "") -> list[bytes]:
    """The keys of the first `blocks` whole blocks of a sequence.

    `media`: (identifier, offset, length) of each media item in the prompt; an item's
    identifier (vLLM's content hash) goes into every block it overlaps, with its offset,
    so two prompts with the same placeholder tokens but other media never share a key.
    `salt`: what else makes rows differ (the LoRA adapter).
    """
    keys, prev = [], hashlib.sha256(salt.encode()).digest()
    ids = np.asarray(tokens[:blocks * block_size], dtype=np.int64)
    for b in range(blocks):
        start, end = b * block_size, (b + 1) * block_size
        h = hashlib.sha256(prev)
        h.update(ids[start:end].tobytes())
        for identifier, offset, length in media:
            if offset < end and offset + length > start:
                h.update(f"|{identifier}@{offset}".encode())
        prev = h.digest()
        keys.append(prev)
    return keys


class RowBlockCache:
    """Blocks of rows by key, least recently used first out."""

    def __init__(self, budget: int, block_size: int):
        self.budget = budget
        self.block_size = block_size
        self.used = 0
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, keys: Sequence[bytes], rows: np.ndarray) -> None:
        """Keep rows[b * block_size:(b + 1) * block_size] under keys[b]."""
        bs = self.block_size
        for b, key in enumerate(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            block = np.ascontiguousarray(rows[b * bs:(b + 1) * bs], dtype=np.float32)
            if block.shape[0] != bs or block.nbytes > self.budget:
                return
            self._blocks[key] = block
            self.used += block.nbytes
            while self.used > self.budget:
                _, old = self._blocks.popitem(last=False)
                self.used -= old.nbytes

    def get(self, keys: Sequence[bytes]) -> np.ndarray | None:
        """The rows of all these blocks in order, or None when any is missing."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                return None
            found.append(block)
        for key in keys:
            self._blocks.move_to_end(key)
        return np.concatenate(found) if found else None


class LiveRows:
    """The rows one running capturing request has so far, from position 0."""

    def __init__(self, width: int):
        self.width = width
        self.count = 0
        self._chunks: list[np.ndarray] = []
        self.missed = False  # rows before what it computed were not available: keep none

    def add(self, position: int, data: np.ndarray) -> None:
        """Rows [position, position + len(data)); positions seen already (a preempted
        request recomputed) are kept as they were."""
        if position > self.count:  # a gap: rows before it were never seen here
            self.missed = True
        if self.missed:
            return
        new = data[self.count - position:]
        if len(new):
            self._chunks.append(new)
            self.count += len(new)

    def rows(self) -> np.ndarray:
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0] if self._chunks else np.zeros((0, self.width), np.float32)
