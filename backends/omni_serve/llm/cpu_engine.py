"""How a stage starts its vLLM AsyncLLM, and on CPU where its one worker runs (opt-in: inside).

Runs in a vLLM-hosted stage's stub (llm/engine_host.py), once, while its AsyncLLM
starts; `omni-bench llm` starts its in-process baseline with the same `start`.

vLLM's CPU platform always uses the multiprocess executor: the engine core process
schedules each step and hands it to a worker process through a shared-memory queue,
and the worker hands the outputs back. That hand-over is most of a small model's
step (tiny Qwen2, one stream: 3.0 ms a token with the worker apart, 1.9 ms with it
inside the engine core; 32 streams: 6500 vs 8800 tokens/s), and on a 2-core host the
two processes polling each other take CPU from everything else. A GPU engine of one
device already runs this way (vLLM's `uni` executor).

It is off by default: on a 2-core host (Linux 6.18.44) busy with other work, a
spoken reply's first audio reached the client after 3-5 s instead of 0.7-1.0 s,
though the orchestrator had sent it at 0.5 s. The kernel kept every process of the
client's session off both cores for seconds while the server's session computed
(docs/benchmarks-notes.md); with the worker apart, the engine core blocks on its
worker every step and the stall does not come. Turn it on with
`OMNI_VLLM_WORKER_IN_ENGINE=1` where cores are spare.

With the worker apart (the default), the engine core is forked from the stub rather
than spawned (llm/engine_fork.py: 6 s less per engine start).

`start(engine_args)` makes the AsyncLLM. `in_engine_core(engine_args)` says whether
the worker goes inside: the CPU platform, one worker (no tensor, pipeline or data
parallelism), no executor named in the engine arguments, and
`OMNI_VLLM_WORKER_IN_ENGINE=1`. `spawn_env(vllm_config)` then holds, while the
engine core is spawned, the OpenMP settings vLLM gives a worker process (its thread
count and core binding, from `VLLM_CPU_OMP_THREADS_BIND`), so the model computes on
the same cores with the same threads as it would apart.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from omni_serve import env
from omni_serve.llm import engine_fork

# vLLM's CPU platform turns a `uni` executor back into `mp` unless this is 0; AsyncLLM
# itself always runs the engine core in a process of its own, whatever it says
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def in_engine_core(engine_args: dict[str, Any], *, is_cpu: bool | None = None) -> bool:
    """Whether the worker of the engine `engine_args` describes runs in its engine core."""
    if env.VLLM_WORKER_IN_ENGINE.get() != "1":
        return False
    if engine_args.get("distributed_executor_backend") is not None:
        return False  # the user chose
    if any(int(engine_args.get(name) or 1) != 1 for name in _PARALLEL_ARGS):
        return False
    if is_cpu is None:
        from vllm.platforms import current_platform

        is_cpu = current_platform.is_cpu()
    return bool(is_cpu)


def prepare(engine_args: dict[str, Any]) -> dict[str, Any]:
    """`engine_args` with the `uni` executor, and this process told to keep it (call
    before the engine's config is made: the platform reads it then)."""
    os.environ[MULTIPROCESSING_ENV] = "0"
    return {**engine_args, "distributed_executor_backend": "uni"}


@contextlib.contextmanager
def spawn_env(vllm_config: Any) -> Iterator[None]:
    """vLLM's OpenMP environment of local rank 0, set while the engine core is spawned."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield


def start(engine_args: dict[str, Any], **async_llm_kwargs: Any) -> Any:
    """A started vLLM AsyncLLM for `engine_args`, its worker placed as above."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    inside = in_engine_core(engine_args)
    args = AsyncEngineArgs(**(prepare(engine_args) if inside else engine_args))
    vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    if inside:
        placed = spawn_env(vllm_config)
    elif engine_fork.enabled():
        placed = engine_fork.forking()
    else:
        placed = contextlib.nullcontext()
    with placed:
        return AsyncLLM.from_vllm_config(vllm_config,
                                         enable_log_requests=args.enable_log_requests,
                                         disable_log_stats=args.disable_log_stats,
                                         **async_llm_kwargs)
