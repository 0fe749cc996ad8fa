"""Triton glue shared by the backends/*/model.py adapters (runs inside the Triton stub).

The only module besides the adapters that imports triton_python_backend_utils
(imported lazily, so importing omni_serve never needs a server). It maps the
error taxonomy onto Triton error codes, reads inputs by contract, sends
decoupled responses from a dedicated thread and registers custom metrics.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from omni_serve.contract import StageContract
from omni_serve.errors import RequestError, StageUnavailableError

log = logging.getLogger(__name__)


def pb():
    import triton_python_backend_utils as pb_utils  # noqa: PLC0415

    return pb_utils


def triton_error(exc: Exception):
    """A pb_utils.TritonError with the code our taxonomy gives `exc`."""
    pb_utils = pb()
    if isinstance(exc, RequestError):
        code = pb_utils.TritonError.INVALID_ARG
    elif isinstance(exc, StageUnavailableError):
        code = pb_utils.TritonError.UNAVAILABLE
    else:
        code = pb_utils.TritonError.INTERNAL
    msg = str(exc) if isinstance(exc, (RequestError, StageUnavailableError)) else (
        f"{type(exc).__name__}: {exc}")
    return pb_utils.TritonError(msg, code)


def read_inputs(request, contract: StageContract) -> dict[str, np.ndarray | None]:
    """Every contract input of `request` as numpy (None when not sent)."""
    pb_utils = pb()
    out: dict[str, np.ndarray | None] = {}
    for spec in contract.inputs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        out[spec.name] = None if tensor is None else tensor.as_numpy()
    return out


def request_parameters(request) -> dict[str, Any]:
    raw = request.parameters()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError("parameters", f"invalid JSON ({e.msg})") from e
    return value if isinstance(value, dict) else {}


def make_response(tensors: dict[str, np.ndarray]):
    pb_utils = pb()
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, arr) for name, arr in tensors.items()])


class ResponseSender:
    """Sends decoupled responses from its own thread, in submission order.

    The engine loop only enqueues (sender, build, final); `build` turns the
    stage's output into a pb_utils.InferenceResponse (or None for a bare
    final flag) on this thread. A send to a cancelled or vanished request is
    logged and dropped: the client is gone, the stage goes on.
    """

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def put(self, response_sender, build: Callable[[], Any], final: bool) -> None:
        self._q.put((response_sender, build, final))

    def _run(self) -> None:
        pb_utils = pb()
        final_flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        while True:
            item = self._q.get()
            if item is None:
                return
            response_sender, build, final = item
            try:
                response = build()
                if response is None:
                    response_sender.send(flags=final_flag)
                else:
                    response_sender.send(response, flags=final_flag if final else 0)
            except Exception as e:  # client gone / cancelled: nothing left to tell it
                log.debug("dropping a response: %s", e)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


class Metrics:
    """Creates Triton custom metric families once per process and hands out metrics."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self._families: list[Any] = []

    def _family(self, name: str, doc: str, kind: str):
        pb_utils = pb()
        fam = pb_utils.MetricFamily(name=name, description=doc,
                                    kind=getattr(pb_utils.MetricFamily, kind))
        self._families.append(fam)
        return fam

    def counter(self, name: str, doc: str):
        return self._family(name, doc, "COUNTER").Metric(labels=self.labels)

    def gauge(self, name: str, doc: str):
        return self._family(name, doc, "GAUGE").Metric(labels=self.labels)

    def histogram(self, name: str, doc: str, buckets: Iterable[float]):
        return self._family(name, doc, "HISTOGRAM").Metric(labels=self.labels,
                                                           buckets=list(buckets))
