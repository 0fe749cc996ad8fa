"""Compatibility shim: vllm-omni 0.30.0 on this checkout's vLLM 0.32 (CPU build).

Benchmark-only (never imported by the product). vllm-omni 0.30 was built against
vLLM 0.30; this module papers over the vLLM API it imports that 0.32 renamed or
dropped, without editing vllm-omni's files. `install()` adds an import hook that
applies the patches just before `vllm_omni` is first imported, so spawned worker
processes get them too (tools/bench/vllm_omni_setup.sh writes a .pth that calls
`install()` when OMNI_VLLM_OMNI_SHIM is set).
"""
from __future__ import annotations

import importlib.abc
import sys

APPLIED: list[str] = []  # what the shim patched, for the benchmark's notes


def _note(what: str) -> None:
    APPLIED.append(what)


def _missing_names() -> None:
    """Names vllm-omni imports from vLLM that 0.32 no longer has."""
    from dataclasses import dataclass

    import numpy as np
    import vllm.v1.outputs as outputs

    if not hasattr(outputs, "RoutedExpertsLists"):
        @dataclass
        class RoutedExpertsLists:  # vLLM 0.30's MoE routing capture (unused on CPU)
            routing_data: np.ndarray
            slot_mapping: np.ndarray

        outputs.RoutedExpertsLists = RoutedExpertsLists
        _note("vllm.v1.outputs.RoutedExpertsLists (stub dataclass)")

    import vllm.multimodal.processing.processor as processor

    if not hasattr(processor, "MultiModalProcessingInfo"):
        # 0.30's cache-path result; 0.32 returns MultiModalProcessingResult (which
        # also carries prompt_ids). Only Qwen2.5-Omni's audio-in-video cache path builds it.
        @dataclass
        class MultiModalProcessingInfo:
            kwargs: object
            hashes: object
            prompt_updates: object

        processor.MultiModalProcessingInfo = MultiModalProcessingInfo
        _note("vllm.multimodal.processing.processor.MultiModalProcessingInfo (stub dataclass)")

    import vllm.v1.engine.utils as engine_utils

    if not hasattr(engine_utils, "get_engine_zmq_addresses"):
        # 0.32 split it into get_engine_zmq_bind_addresses + bind_engine_zmq_listeners;
        # for one local client the bind templates are IPC paths, usable as they are.
        def get_engine_zmq_addresses(vllm_config, num_api_servers: int = 1):
            bind = engine_utils.get_engine_zmq_bind_addresses(vllm_config, num_api_servers)
            return engine_utils.EngineZmqAddresses(inputs=bind.inputs, outputs=bind.outputs)

        engine_utils.get_engine_zmq_addresses = get_engine_zmq_addresses
        _note("vllm.v1.engine.utils.get_engine_zmq_addresses (from get_engine_zmq_bind_addresses)")

    import vllm.v1.worker.utils as worker_utils

    if not hasattr(worker_utils, "is_residual_scattered_for_sp"):
        # used by vllm-omni's GPU AR model runner under pipeline parallelism only;
        # without sequence parallelism the residual is never scattered
        def is_residual_scattered_for_sp(vllm_config, num_input_tokens: int) -> bool:
            sp = getattr(vllm_config.compilation_config.pass_config, "enable_sp", False)
            return bool(sp) and vllm_config.parallel_config.tensor_parallel_size > 1

        worker_utils.is_residual_scattered_for_sp = is_residual_scattered_for_sp
        _note("vllm.v1.worker.utils.is_residual_scattered_for_sp (False without SP)")


def _engine_client_abstracts() -> None:
    """Abstract EngineClient methods 0.32 added that vllm-omni's AsyncOmni lacks."""
    from vllm.engine.protocol import EngineClient

    added = []
    for name in sorted(EngineClient.__abstractmethods__):
        if name in ("release_kv_cache_memory",):
            async def not_supported(self, *args, _name=name, **kwargs):
                raise NotImplementedError(f"{_name} (vLLM 0.32) is not in vllm-omni 0.30")

            setattr(EngineClient, name, not_supported)
            added.append(name)
    if added:
        EngineClient.__abstractmethods__ = frozenset(EngineClient.__abstractmethods__ - set(added))
        _note(f"vllm.engine.protocol.EngineClient.{'/'.join(added)}: abstract -> NotImplementedError")


PATCHES = [_missing_names, _engine_client_abstracts]


def apply() -> None:
    if APPLIED:
        return
    for patch in PATCHES:
        patch()


def _sdpa_on_cpu(sdpa) -> None:
    """vllm-omni's diffusion AttentionImpl.forward dispatches by platform (cuda/hip/npu/
    xpu/musa) and has no CPU branch; on CPU send SDPAImpl to its plain-torch path, the
    one CUDA/XPU use (torch.nn.functional.scaled_dot_product_attention)."""
    original = sdpa.SDPAImpl.forward

    def forward(self, query, key, value, attn_metadata=None):
        if query.device.type == "cpu":
            return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")
        return original(self, query, key, value, attn_metadata)

    sdpa.SDPAImpl.forward = forward
    _note("vllm_omni SDPAImpl.forward: CPU tensors -> its torch SDPA path")


# patches of vllm-omni's own modules, applied right after each is first executed
AFTER_IMPORT = {"vllm_omni.diffusion.attention.backends.sdpa": _sdpa_on_cpu}


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm_omni":
            apply()
        if name not in AFTER_IMPORT:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module, _exec=exec_module, _patch=AFTER_IMPORT[name]):
            _exec(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
