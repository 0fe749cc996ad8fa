"""The orchestrator's StageClient over Triton gRPC (runs on the orchestrator's event loop).

Every stage call is an ordinary Triton gRPC request (tritonclient's asyncio
client and Triton's service stub), to this server (the default: its gRPC
endpoint is read from the tritonserver command line) or to another one. No
Python-backend objects cross threads, a child stream is cancelled like any
client's (Triton then cancels the request, omni_llm aborts it in vLLM), and
errors keep their gRPC status (the `triton_grpc_error` stream header).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np

from omni_serve.orchestrator.pipeline import StageCallError

_WIRE = {np.dtype(np.bool_): "BOOL", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
         np.dtype(np.float32): "FP32", np.dtype(np.uint8): "UINT8", np.dtype(np.uint32): "UINT32"}
_STATUS = {"INVALID_ARGUMENT": "INVALID_ARG", "UNAVAILABLE": "UNAVAILABLE",
           "NOT_FOUND": "UNAVAILABLE", "CANCELLED": "CANCELLED",
           "DEADLINE_EXCEEDED": "UNAVAILABLE"}
_STRICT_ERRORS = (("triton_grpc_error", "true"),)


def local_grpc_url(parent_pid: int | None = None) -> str:
    """This tritonserver's gRPC endpoint, from its command line (the stub's parent process).

    `OMNI_TRITON_GRPC_URL` overrides it. Raises ValueError when gRPC is off.
    """
    if os.environ.get("OMNI_TRITON_GRPC_URL"):
        return os.environ["OMNI_TRITON_GRPC_URL"]
    pid = os.getppid() if parent_pid is None else parent_pid
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        argv = []
    return grpc_url_from_args(argv)


def grpc_url_from_args(argv: Sequence[str]) -> str:
    """The gRPC endpoint tritonserver serves with these arguments (127.0.0.1:8001 by default)."""
    opts: dict[str, str] = {}
    args = list(argv)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        opts[key.replace("_", "-")] = value
    if opts.get("allow-grpc", "true").lower() in ("false", "0", "no"):
        raise ValueError("tritonserver runs with --allow-grpc=false; the orchestrator's grpc "
                         "transport needs it (or set triton_url / OMNI_TRITON_GRPC_URL)")
    host = opts.get("grpc-address", "0.0.0.0")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"{host}:{opts.get('grpc-port', '8001')}"


def _code(status) -> str:
    return _STATUS.get(getattr(status, "name", str(status)), "INTERNAL")


class GrpcStageClient:
    """StageClient over Triton gRPC; create and use it on one event loop."""

    def __init__(self, url: str):
        self.url = url
        self._client = None

    def _connect(self):
        if self._client is None:
            import tritonclient.grpc.aio as grpcaio  # noqa: PLC0415

            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    @staticmethod
    def _inputs(inputs: dict[str, np.ndarray]):
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        out = []
        for name, arr in inputs.items():
            arr = np.asarray(arr)
            wire = "BYTES" if arr.dtype == np.object_ else _WIRE[arr.dtype]
            tensor = grpcclient.InferInput(name, list(arr.shape), wire)
            tensor.set_data_from_numpy(arr)
            out.append(tensor)
        return out

    @staticmethod
    def _outputs(result, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        names = {o.name for o in result.get_response().outputs}
        return {name: result.as_numpy(name) for name in outputs if name in names}

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]:
        import tritonclient.grpc as grpcclient  # noqa: PLC0415
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        try:
            result = await self._connect().infer(
                model, self._inputs(inputs),
                outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
        except InferenceServerException as e:
            raise StageCallError(_STATUS.get((e.status() or "").removeprefix("StatusCode."),
                                             "INTERNAL"), e.message()) from e
        return self._outputs(result, outputs)

    async def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str], *,
                     request_id: str, timeout_s: float) -> AsyncIterator[dict[str, np.ndarray]]:
        import grpc  # noqa: PLC0415
        import tritonclient.grpc as grpcclient  # noqa: PLC0415
        from tritonclient.grpc._utils import _get_inference_request  # noqa: PLC0415

        request = _get_inference_request(
            model_name=model, inputs=self._inputs(inputs), model_version="", request_id=request_id,
            outputs=[grpcclient.InferRequestedOutput(o) for o in outputs], sequence_id=0,
            sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=None)
        # the last response says so (Triton's `triton_final_response`), even an empty one
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        done = asyncio.Event()

        async def requests():
            yield request
            await done.wait()  # keep the stream open until the request is complete

        client = self._connect()
        call = client._client_stub.ModelStreamInfer(requests(), metadata=_STRICT_ERRORS)
        finished = False
        try:
            while True:
                try:
                    response = await asyncio.wait_for(call.read(), timeout_s)
                except TimeoutError:
                    raise StageCallError("UNAVAILABLE", f"no response for {timeout_s:g} s") from None
                except grpc.aio.AioRpcError as e:
                    finished = True
                    raise StageCallError(_code(e.code()), e.details() or str(e)) from None
                if response is grpc.aio.EOF:
                    finished = True
                    return
                if response.error_message:
                    finished = True
                    raise StageCallError("INTERNAL", response.error_message)
                result = grpcclient.InferResult(response.infer_response)
                final = response.infer_response.parameters.get("triton_final_response")
                out = self._outputs(result, outputs)
                if final is not None and final.bool_param:
                    finished = True
                    if out:
                        yield out
                    return
                if out:
                    yield out
        finally:
            done.set()
            if not finished:
                call.cancel()  # Triton cancels the request; omni_llm aborts it in the engine

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class RoutingStageClient:
    """Sends each model's calls to the server that has it (the local one by default)."""

    def __init__(self, local: GrpcStageClient, remote: dict[str, GrpcStageClient]):
        self.local = local
        self.remote = remote

    def _for(self, model: str) -> GrpcStageClient:
        return self.remote.get(model, self.local)

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    outputs: Sequence[str]) -> dict[str, np.ndarray]:
        return await self._for(model).infer(model, inputs, outputs)

    def stream(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str], *,
               request_id: str, timeout_s: float) -> AsyncIterator[dict[str, np.ndarray]]:
        return self._for(model).stream(model, inputs, outputs, request_id=request_id,
                                       timeout_s=timeout_s)


def stage_client(local_url: str, remote_urls: dict[str, str]) -> GrpcStageClient | RoutingStageClient:
    """One gRPC client per server; a router when some stages are remote."""
    local = GrpcStageClient(local_url)
    if not remote_urls:
        return local
    by_url: dict[str, GrpcStageClient] = {}
    remote = {model: by_url.setdefault(url, GrpcStageClient(url)) for model, url in remote_urls.items()}
    return RoutingStageClient(local, remote)
