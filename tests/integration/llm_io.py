"""Raw tritonclient helpers for the LLM stage tests (vllm_backend-style tensors)."""
from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from omni_serve.contract import LLM
from omni_tools.server import metric_sample

MODEL = "llm"


@dataclass
class Result:
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    error: InferenceServerException | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def llm_inputs(prompt, *, stream: bool | None, sampling: dict | str | None = None,
               flags: bool = True, exclude_input: bool | None = True):
    def t(name, arr, dtype):
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

    if isinstance(prompt, np.ndarray):
        ins = [t(LLM.TEXT_INPUT, prompt, "INT32" if prompt.dtype == np.int32 else "BYTES")]
    else:
        ins = [t(LLM.TEXT_INPUT, np.array([prompt.encode()], dtype=object), "BYTES")]
    if stream is not None:  # None: leave the tensor out (parameters may set it)
        ins.append(t(LLM.STREAM, np.array([stream]), "BOOL"))
    if sampling is not None:
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        ins.append(t(LLM.SAMPLING_PARAMETERS, np.array([raw.encode()], dtype=object), "BYTES"))
    if exclude_input is not None:
        ins.append(t(LLM.EXCLUDE_INPUT_IN_OUTPUT, np.array([exclude_input]), "BOOL"))
    if flags:
        for name in (LLM.RETURN_FINISH_REASON, LLM.RETURN_NUM_INPUT_TOKENS,
                     LLM.RETURN_NUM_OUTPUT_TOKENS):
            ins.append(t(name, np.array([True]), "BOOL"))
    return ins


class Stream:
    """One gRPC stream to the LLM model; responses land in a queue."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def send(self, inputs, parameters=None, request_id: str = ""):
        self.client.async_stream_infer(MODEL, inputs, parameters=parameters,
                                       request_id=request_id,
                                       enable_empty_final_response=True)

    def next(self, timeout: float = 60.0):
        return self.q.get(timeout=timeout)

    def collect(self, timeout: float = 60.0) -> Result:
        res = Result()
        while True:
            result, error = self.next(timeout)
            if error is not None:
                res.error = error
                return res
            text = result.as_numpy(LLM.TEXT_OUTPUT)
            if text is not None:
                res.deltas.append(text[0].decode())
                fr = result.as_numpy(LLM.FINISH_REASON)
                res.finish_reason = fr[0].decode() if fr is not None else None
                n_in = result.as_numpy(LLM.NUM_INPUT_TOKENS)
                n_out = result.as_numpy(LLM.NUM_OUTPUT_TOKENS)
                res.num_input_tokens = int(n_in[0]) if n_in is not None else None
                if n_out is not None:  # each response counts the tokens it adds
                    res.num_output_tokens = (res.num_output_tokens or 0) + int(n_out[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                return res

    def close(self, cancel: bool = False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def run(url: str, prompt, *, stream: bool | None, sampling=None, parameters=None, **kw) -> Result:
    s = Stream(url)
    try:
        s.send(llm_inputs(prompt, stream=stream, sampling=sampling, **kw), parameters)
        return s.collect()
    finally:
        s.close()


def metric(text: str, name: str, model: str = MODEL, **labels: str) -> float:
    """Value of the Prometheus sample `name{model="...",...}` in the metrics text."""
    return metric_sample(text, name, model=model, **labels)


def cancel_limit(sent: int, total: int) -> float:
    """What an engine may have generated in all when a client cancelled a `total`-token reply
    after receiving `sent` tokens: less than that plus half of what was left (a cancel that
    did nothing leaves it generating `total`)."""
    return sent + (total - sent) / 2


def wait_idle(server, llm_models=(MODEL,), orchestrators=(), timeout: float = 15.0) -> dict:
    """Poll until nothing runs: each orchestrator has no request in flight, each LLM stage
    holds none and its engine runs none. Returns what the last scrape showed.

    Once they are all 0 no token can be generated until a new request comes (the
    orchestrator starts no stage call, the stages count a request's tokens before
    letting it go), so counters read then are final: no settling time is needed.
    """
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        seen = {f"{m} in flight": metric(text, "omni_requests_in_flight", m) for m in orchestrators}
        for m in llm_models:
            seen[f"{m} in flight"] = metric(text, "omni_llm_requests_in_flight", m)
            seen[f"{m} running"] = metric(text, "omni_llm_engine_running_requests", m)
        if not any(seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)
