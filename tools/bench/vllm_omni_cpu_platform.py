"""A CPU OmniPlatform for vllm-omni 0.30 (benchmark-only; it ships CUDA/ROCm/NPU/XPU/MUSA).

Registered as the `cpu` entry point of the `vllm_omni.platform_plugins` group by
tools/bench/vllm_omni_setup.sh (a tiny dist-info in .venv/vllm-omni), so vllm-omni's
own plugin discovery picks it up in every process. vLLM's CpuPlatform supplies the
device basics; this adds what vllm-omni asks of its platform: torch SDPA for
diffusion attention, no inductor, host memory as "device" memory, and vLLM's CPU
worker for the autoregressive stages. Its diffusion attention has no CPU branch:
vllm_omni_shim routes SDPAImpl to its plain-torch path.
"""
from __future__ import annotations

import os

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


def _host_memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


class CPUOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "vllm_omni.worker.gpu_ar_worker.GPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device=None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return _host_memory()[0]

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return _host_memory()

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _host_memory()[1]


def cpu_omni_platform_plugin() -> str | None:
    """The `vllm_omni.platform_plugins` entry point: active when the shim is on."""
    if not os.environ.get("OMNI_VLLM_OMNI_SHIM"):
        return None
    return "vllm_omni_cpu_platform.CPUOmniPlatform"
