"""The engine-side cache of hidden-state rows for prefix-cached positions (llm/row_cache.py)."""
from __future__ import annotations

import numpy as np
import pytest

from omni_serve.llm import row_cache
from omni_serve.llm.row_cache import LiveRows, RowBlockCache, block_keys

BS = 4
TOKENS = list(range(100, 112))  # three blocks of 4


def rows(n: int, start: int = 0, width: int = 6) -> np.ndarray:
    return np.arange(start * width, (start + n) * width, dtype=np.float32).reshape(n, width)


def test_keys_chain_so_a_block_depends_on_everything_before_it():
    keys = block_keys(TOKENS, [], BS, 3)
    assert len(set(keys)) == 3
    assert block_keys(TOKENS[:8], [], BS, 2) == keys[:2]  # a prefix has the same keys
    changed = block_keys([999] + TOKENS[1:], [], BS, 3)
    assert all(a != b for a, b in zip(keys, changed))  # token 0 changes every later block


def test_media_and_adapter_are_part_of_the_key():
    image = [("hash-a", 5, 2)]  # placeholder positions 5 and 6: block 1 only
    keys = block_keys(TOKENS, image, BS, 3)
    plain = block_keys(TOKENS, [], BS, 3)
    assert keys[0] == plain[0] and keys[1] != plain[1]
    other = block_keys(TOKENS, [("hash-b", 5, 2)], BS, 3)
    assert other[0] == keys[0] and other[1] != keys[1]  # same placeholders, other picture
    assert block_keys(TOKENS, [], BS, 3, salt="adapter") != plain


def test_the_cache_gives_all_blocks_or_none_and_evicts_the_least_recently_used():
    keys = block_keys(TOKENS, [], BS, 3)
    block_bytes = rows(BS).nbytes
    cache = RowBlockCache(budget=2 * block_bytes, block_size=BS)
    cache.put(keys[:2], rows(8))
    assert np.array_equal(cache.get(keys[:2]), rows(8))
    assert cache.get(keys) is None  # the third was never kept
    cache.get(keys[:1])  # block 0 used last: block 1 goes first
    cache.put(keys[2:], rows(4, start=8))
    assert len(cache) == 2 and cache.used == 2 * block_bytes
    assert cache.get(keys[1:2]) is None
    assert np.array_equal(cache.get([keys[0], keys[2]]),
                          np.concatenate([rows(4), rows(4, start=8)]))


def test_a_partial_block_is_not_kept():
    keys = block_keys(TOKENS, [], BS, 2)
    cache = RowBlockCache(budget=1 << 20, block_size=BS)
    cache.put(keys, rows(6))  # the second block has 2 of its 4 rows
    assert len(cache) == 1 and cache.get(keys[1:]) is None


def test_live_rows_keep_positions_in_order_and_a_gap_marks_them_missed():
    live = LiveRows(6)
    live.add(0, rows(3))
    live.add(3, rows(1, start=3))
    live.add(2, rows(3, start=2))  # a preempted request recomputes 2 and 3, then goes on
    assert live.count == 5 and np.array_equal(live.rows(), rows(5))
    gap = LiveRows(6)
    gap.add(4, rows(2, start=4))
    assert gap.missed and gap.count == 0


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("OMNI_HIDDEN_ROWS_CACHE_MB", "0.5")
    assert row_cache.budget_bytes() == 2**19
    monkeypatch.setenv("OMNI_HIDDEN_ROWS_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="OMNI_HIDDEN_ROWS_CACHE_MB"):
        row_cache.budget_bytes()
