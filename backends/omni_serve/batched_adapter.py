"""The one `execute` of the dynamic-batched stages (omni_dit, omni_audio, omni_encoder).

Runs in a batched stage's Triton stub. Triton's dynamic batcher hands a list of
requests; each is parsed on its own (a bad or cancelled one gets its own error
response), the good ones go to the stage's runner in one call, and the
results are zipped back onto their requests in order. The runner may answer
an item with an exception (it failed alone: omni_serve.batching.isolate); that
request gets the error, its batch-mates their results.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from omni_serve.metrics_table import MetricTable
from omni_serve.tritonio import Metrics, parse_each, pb, triton_error


class BatchedExecute:
    """`execute(requests)` for a stage: parse each, run the good ones, answer each.

    parse(request) -> item; run(items) -> one result (or exception) per item;
    respond(request, item, result) -> the InferenceResponse of a good result.
    Records the batch size in the stage table's `BATCH_SIZE` histogram and the
    run time in its `COMPUTE_SECONDS` counter (omni_serve.metrics_table).
    """

    def __init__(self, metrics: Metrics, table: type[MetricTable],
                 parse: Callable[[Any], Any], run: Callable[[list[Any]], Sequence[Any]],
                 respond: Callable[[Any, Any, Any], Any]):
        self._batch = metrics.histogram(table.BATCH_SIZE)
        self._busy = metrics.counter(table.COMPUTE_SECONDS)
        self._parse = parse
        self._run = run
        self._respond = respond

    def __call__(self, requests) -> list[Any]:
        self._batch.observe(len(requests))
        parsed = parse_each(requests, self._parse)
        good = [p for p in parsed if not isinstance(p, Exception)]
        t0 = time.perf_counter()
        results = iter(self._run(good)) if good else iter(())
        self._busy.increment(time.perf_counter() - t0)
        responses = []
        for request, item in zip(requests, parsed):
            result = item if isinstance(item, Exception) else next(results)
            if isinstance(result, Exception):
                responses.append(pb().InferenceResponse(error=triton_error(result)))
            else:
                responses.append(self._respond(request, item, result))
        return responses
