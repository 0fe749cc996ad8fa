"""Triton glue shared by the backends/*/model.py adapters (runs inside the Triton stub).

The only module besides the adapters that imports triton_python_backend_utils
(imported lazily, so importing omni_serve never needs a server). It maps the
error taxonomy onto Triton error codes, reads inputs by contract, sends
decoupled responses from a dedicated thread and registers custom metrics.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from omni_serve.contract import (
    DEFAULT_MAX_BATCH_SIZE,
    ENGINE_ARGS_FILE,
    ENV_PARAMETER_PREFIX,
    StageContract,
)
from omni_serve.errors import (
    RequestCancelledError,
    RequestError,
    StageFailedError,
    StageUnavailableError,
)
from omni_serve.metrics_table import MetricSpec

log = logging.getLogger(__name__)


def pb():
    import triton_python_backend_utils as pb_utils

    return pb_utils


def triton_error(exc: Exception):
    """A pb_utils.TritonError with the code our taxonomy gives `exc`."""
    pb_utils = pb()
    if isinstance(exc, RequestError):
        code = pb_utils.TritonError.INVALID_ARG
    elif isinstance(exc, StageUnavailableError):
        code = pb_utils.TritonError.UNAVAILABLE
    elif isinstance(exc, RequestCancelledError):
        code = getattr(pb_utils.TritonError, "CANCELLED", pb_utils.TritonError.UNAVAILABLE)
    elif isinstance(exc, StageFailedError):
        code = getattr(pb_utils.TritonError, exc.code, pb_utils.TritonError.INTERNAL)
    else:
        code = pb_utils.TritonError.INTERNAL
    msg = str(exc) if isinstance(exc, (RequestError, StageUnavailableError, StageFailedError,
                                       RequestCancelledError)) else (
        f"{type(exc).__name__}: {exc}")
    return pb_utils.TritonError(msg, code)


def apply_stage_env(args: dict) -> dict[str, str]:
    """Set the `env.<NAME>` parameters of the model config in this (stub) process, and
    place a KIND_GPU instance on the GPU Triton gave it.

    Call first in initialize(): processes the stage starts afterwards (vLLM's
    engine core) inherit them. Each instance is a stub process of its own, so a
    KIND_GPU instance sees only its device (`CUDA_VISIBLE_DEVICES` = Triton's
    `model_instance_device_id`, as vllm_backend does): vLLM and torch stages
    (`device: cuda`) run on it as `cuda:0`. KIND_CPU and KIND_MODEL change
    nothing. Returns what was set.
    """
    config = json.loads(args["model_config"]) if isinstance(args.get("model_config"), str) else {}
    env = {key[len(ENV_PARAMETER_PREFIX):]: value.get("string_value", "")
           for key, value in (config.get("parameters") or {}).items()
           if key.startswith(ENV_PARAMETER_PREFIX)}
    env.update(instance_device_env(args))
    os.environ.update(env)
    return env


def instance_device_env(args: dict) -> dict[str, str]:
    """{"CUDA_VISIBLE_DEVICES": <device id>} for a KIND_GPU instance, else {}."""
    if str(args.get("model_instance_kind", "")).upper() != "GPU":
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(int(args.get("model_instance_device_id", 0)))}


def stage_config(args: dict, config_class: type):
    """The stage's engine.json (next to config.pbtxt), validated by its typed config class."""
    with open(os.path.join(args["model_repository"], ENGINE_ARGS_FILE)) as f:
        return config_class.model_validate(json.load(f))


def auto_complete(config, contract: StageContract):
    """Triton's auto_complete_config for a stage: what config.pbtxt leaves out comes from
    the contract, so a bare `backend: "omni_llm"` config loads (as vllm_backend's does).

    Adds the contract's inputs and outputs that the config does not name (named ones
    are kept as written), the decoupled transaction policy of a decoupled stage, and
    for a Triton-batched stage with no (or a 0) max_batch_size the default one with
    dynamic batching (its dims exclude the batch dimension); an engine-batched stage
    (vLLM) gets max_batch_size 0.
    """
    current = config.as_dict()
    named_in = {t["name"] for t in current.get("input", [])}
    named_out = {t["name"] for t in current.get("output", [])}
    for spec in contract.inputs:
        if spec.name not in named_in:
            entry = spec.config_entry(is_input=True)
            # the Python backend's auto-complete cannot set it: unequal lengths then
            # batch apart (write the input in config.pbtxt to batch them together)
            entry.pop("allow_ragged_batch", None)
            config.add_input(entry)
    for spec in contract.outputs:
        if spec.name not in named_out:
            config.add_output(spec.config_entry(is_input=False))
    if contract.decoupled:
        config.set_model_transaction_policy({"decoupled": True})
    if contract.batching == "engine":
        config.set_max_batch_size(0)
    elif not current.get("max_batch_size"):
        config.set_max_batch_size(DEFAULT_MAX_BATCH_SIZE)
        config.set_dynamic_batching()
    return config


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


class Outbox:
    """One request's pending responses; the stage sends, the sender thread flushes.

    It is the `Sink` the stages write to (`send(item)`, `fail(exc)`).

    While a request waits in the sender's queue, further items pile up here
    and are handed to `merge` together, so a busy sender sends one response
    carrying several deltas instead of falling further behind. `on_cancel`
    runs (on the sender thread) when the client cancels the request.
    """

    __slots__ = ("response_sender", "on_cancel", "_merge", "_items", "_lock", "_queued",
                 "_sender")

    def __init__(self, sender: ResponseSender, response_sender,
                 merge: Callable[[list[Any]], tuple[Any, bool]],
                 on_cancel: Callable[[], None] | None = None):
        self.response_sender = response_sender
        self.on_cancel = on_cancel
        self._sender = sender
        self._merge = merge
        self._items: list[Any] = []
        self._lock = threading.Lock()
        self._queued = False
        if on_cancel is not None:
            sender.watch(self)

    def send(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            if self._queued:
                return
            self._queued = True
        self._sender.enqueue(self)

    def fail(self, exc: Exception) -> None:
        self.send(exc)

    def take(self) -> list[Any]:
        with self._lock:
            items, self._items = self._items, []
            self._queued = False
        return items

    def build(self, items: list[Any]) -> tuple[Any, bool]:
        """(response, final) for what was pending; an error ends the request."""
        errors = [i for i in items if isinstance(i, Exception)]
        if errors:
            return pb().InferenceResponse(error=triton_error(errors[0])), True
        return self._merge(items)


def parse_each(requests: Iterable[Any], parse: Callable[[Any], Any]) -> list[Any]:
    """`parse(request)` of each request of a batch, or the exception that request gets:
    a bad request, or one its client cancelled while it waited in the queue, answers
    alone and its batch-mates run. (Triton's dynamic batcher drops requests cancelled in
    its queue itself; this catches those cancelled while their batch formed.)"""
    parsed: list[Any] = []
    for request in requests:
        try:
            if _cancelled(request):
                raise RequestCancelledError("the request was cancelled before it ran; nothing "
                                            "was computed for it")
            parsed.append(parse(request))
        except Exception as e:  # each request answers alone
            parsed.append(e)
    return parsed


def _cancelled(request) -> bool:
    is_cancelled = getattr(request, "is_cancelled", None)  # Python backend >= 23.10
    return bool(is_cancelled()) if is_cancelled is not None else False


class ResponseSender:
    """The one thread that talks to Triton's response senders of a model instance.

    The engine loop only pushes into an Outbox; this thread builds the
    pb_utils responses and sends them, so a slow client or a busy stub never
    stalls the engine. Errors go out with the FINAL flag in the same send
    (Triton < 2.68 can crash when they come apart under triton_grpc_error).
    It also polls watched requests for client cancellation: doing both on
    one thread guarantees `is_cancelled()` is never called on a request
    whose FINAL response was sent (Triton frees it then; calling it
    afterwards segfaults the server).
    """

    def __init__(self, name: str, cancel_poll_s: float = 0.1):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._watched: set[Outbox] = set()
        self._watched_lock = threading.Lock()
        self._poll_s = cancel_poll_s
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def enqueue(self, outbox: Outbox) -> None:
        self._q.put(outbox)

    def watch(self, outbox: Outbox) -> None:
        with self._watched_lock:
            self._watched.add(outbox)

    def _unwatch(self, outbox: Outbox) -> None:
        with self._watched_lock:
            self._watched.discard(outbox)

    def send_error(self, response_sender, exc: Exception) -> None:
        """Answer a request that never reached the stage with its error."""
        Outbox(self, response_sender, merge=lambda items: (None, True)).fail(exc)

    def _run(self) -> None:
        final_flag = pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        next_poll = time.monotonic() + self._poll_s
        while True:
            try:
                outbox = self._q.get(timeout=self._poll_s)
            except queue.Empty:
                outbox = False
            if outbox is None:
                return
            if outbox:
                self._flush(outbox, final_flag)
            if time.monotonic() >= next_poll:
                self._poll_cancellations()
                next_poll = time.monotonic() + self._poll_s

    def _flush(self, outbox: Outbox, final_flag: int) -> None:
        items = outbox.take()
        if not items:
            return
        final = True
        try:
            response, final = outbox.build(items)
            flags = final_flag if final else 0
            if response is None:
                outbox.response_sender.send(flags=flags)
            else:
                outbox.response_sender.send(response, flags=flags)
        except Exception as e:  # client gone / cancelled: nothing left to tell it
            log.debug("dropping a response: %s", e)
        finally:
            if final:
                self._unwatch(outbox)

    def _poll_cancellations(self) -> None:
        with self._watched_lock:
            watched = list(self._watched)
        for outbox in watched:
            try:
                cancelled = outbox.response_sender.is_cancelled()
            except Exception:
                cancelled = True
            if cancelled:
                self._unwatch(outbox)
                try:
                    outbox.on_cancel()
                except Exception:
                    log.exception("cancel callback failed")

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


class _Gauge:
    """A Triton gauge that is sent to the server only when its value changes.

    Each `Metric.set` is a round trip from the stub to its parent process; the llm
    stage sets its scheduler gauges every engine step, where they rarely change.
    """

    def __init__(self, metric: Any):
        self._metric = metric
        self._value: float | None = None

    def set(self, value: float) -> None:
        if value != self._value:
            self._metric.set(value)
            self._value = value


class Metrics:
    """Creates Triton custom metric families once per process and hands out metrics.

    Each family is a MetricSpec of omni_serve.metrics_table, created as declared
    (kind and labels checked)."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self._families: list[Any] = []

    def _family(self, spec: MetricSpec, kind: str, extra: str | None = None):
        if spec.kind != kind:
            raise ValueError(f"{spec.name} is declared a {spec.kind}, not a {kind}")
        labels = (*self.labels, extra) if extra else tuple(self.labels)
        if set(labels) != set(spec.labels):
            raise ValueError(f"{spec.name} is declared with labels {spec.labels}, not {labels}")
        pb_utils = pb()
        fam = pb_utils.MetricFamily(name=spec.name, description=spec.help,
                                    kind=getattr(pb_utils.MetricFamily, kind.upper()))
        self._families.append(fam)
        return fam

    def counter(self, spec: MetricSpec):
        return self._family(spec, "counter").Metric(labels=self.labels)

    def gauge(self, spec: MetricSpec) -> _Gauge:
        return _Gauge(self._family(spec, "gauge").Metric(labels=self.labels))

    def histogram(self, spec: MetricSpec):
        return self._family(spec, "histogram").Metric(labels=self.labels,
                                                      buckets=list(spec.buckets))

    def histograms(self, spec: MetricSpec, label: str, values: Iterable[str]) -> dict[str, Any]:
        """One histogram family, one metric per value of the extra `label`."""
        fam = self._family(spec, "histogram", label)
        return {v: fam.Metric(labels={**self.labels, label: v}, buckets=list(spec.buckets))
                for v in values}

    def counters(self, spec: MetricSpec, label: str, values: Iterable[str]) -> dict[str, Any]:
        """One counter family, one metric per value of the extra `label`."""
        fam = self._family(spec, "counter", label)
        return {v: fam.Metric(labels={**self.labels, label: v}) for v in values}
