"""PyTorch's process-wide settings for one stage (runs in each torch stage's Triton stub).

What flows through it: a stage config's `torch_threads`, `device` and `dtype`; it sets
torch's intra-op threads and, for float32 on CUDA, turns TF32 off. PyTorch runs cuDNN
convolutions in TF32 by default, which on an H200 put transformers' own Qwen3-Omni
Code2Wav 7e-3 and Qwen2.5-Omni's BigVGAN 7e-4 away from their float32 output on the
CPU; with TF32 off both are within 2e-5 (`python -m omni_tools.gpu_stages`, see
tools/gpu_smoke.sh). A stage asked for float32 computes float32; bfloat16 or float16
are the settings that trade exactness for speed.
"""
from __future__ import annotations

import torch


def configure_torch(threads: int, device: str, dtype: str) -> None:
    """Intra-op threads for this process; exact float32 on CUDA where the stage asks for float32."""
    torch.set_num_threads(threads)
    if device == "cuda" and dtype == "float32":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
