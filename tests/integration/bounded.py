"""The spec of a server of two bounded stages, in Triton's default model-control mode.

test_overload floods its stages; test_server_lifecycle SIGKILLs the same server
(conftest.default_mode_server).
"""
from __future__ import annotations

LLM_RUNNING, LLM_QUEUED = 2, 2
SPEC = {
    "pipeline": "overload",
    "stages": {
        "llm": {"backend": "omni_llm", "model": "tiny:qwen2-tiny",
                "engine_args": {"max_model_len": 2048, "enforce_eager": True, "dtype": "float32",
                                "max_num_seqs": LLM_RUNNING},
                "queue": {"max_queue_size": LLM_QUEUED}},
        "dit": {"backend": "omni_dit", "model": "tiny:qwen-image-tiny",
                "engine_args": {"default_height": 64, "default_width": 64, "default_steps": 4,
                                "max_steps": 50, "torch_threads": 1},
                "max_batch_size": 1, "queue": {"max_queue_size": 1}},
    },
    "entry": "llm",
}
