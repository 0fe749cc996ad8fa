"""omni_serve.torch_setup: a float32 stage on CUDA computes float32 (no TF32)."""
from __future__ import annotations

import pytest
import torch

from omni_serve.torch_setup import configure_torch


@pytest.fixture
def flags():
    # (threads are not checked: a vLLM CPU worker loaded in this process earlier makes
    # torch.set_num_threads a no-op)
    saved = (torch.get_num_threads(), torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    yield lambda: (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.set_num_threads(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[1:]


def test_float32_on_cuda_turns_tf32_off(flags):
    configure_torch(1, "cuda", "float32")
    assert flags() == (False, False)


@pytest.mark.parametrize(("device", "dtype"), [("cpu", "float32"), ("cuda", "bfloat16"),
                                               ("cuda", "float16")])
def test_other_settings_keep_torchs_defaults(flags, device, dtype):
    configure_torch(2, device, dtype)
    assert flags() == (True, True)
