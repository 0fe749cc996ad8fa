"""Running a Triton batch as groups of compatible requests (stub process of the batched stages).

Triton's dynamic batcher hands a stage requests that cannot always share one
model call (other image sizes, other chunk lengths). `run_grouped` calls the
stage once per group of equal keys; a group whose call raises is retried one
request at a time, so a bad request fails alone and never its batch-mates.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")


def run_grouped(items: Sequence[Item], key: Callable[[Item], Hashable],
                call: Callable[[list[Item]], Sequence[Any]], *, label: str) -> list[Any]:
    """One result (or the exception it raised) per item, in order."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        groups[key(item)].append(i)
    results: list[Any] = [None] * len(items)
    for indices in groups.values():
        outs = isolate(call, [items[i] for i in indices], label=label)
        for i, out in zip(indices, outs, strict=True):
            results[i] = out
    return results


def isolate(call: Callable[[list[Item]], Sequence[Any]], group: list[Item], *,
            label: str) -> list[Any]:
    """`call(group)`; when it raises, each item alone (its own exception as its result)."""
    try:
        return list(call(group))
    except Exception as e:  # one bad request must not fail its batch-mates: isolate it below
        if len(group) == 1:
            log.warning("%s: request failed: %s", label, e)
            return [e]
        log.warning("%s: batch of %d failed (%s); retrying one by one", label, len(group), e)
    return [out for item in group for out in isolate(call, [item], label=label)]
