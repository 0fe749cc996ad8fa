"""One text-to-image request to a DiT stage over Triton gRPC: the DiT benchmarks' request.

Runs in a benchmark's client (`omni-bench dit`'s threads, `omni-bench vllm-omni`). Request
`i` has a fixed prompt and seed `i`, so every side of a comparison and every run renders the
same images; tools/bench/vllm_omni_run.py sends vLLM-Omni the same prompts and seeds.
"""
from __future__ import annotations

import numpy as np

from omni_serve.contract import DIT


def prompt(i: int) -> str:
    return f"image {i}: a lighthouse at dusk"


def generate(url: str, i: int, size: int, steps: int, *, model: str = "text_to_image",
             output: str = DIT.IMAGE, timeout: float = 300) -> np.ndarray:
    """Request `i` (a `size` x `size` image in `steps` steps); its `output` tensor's row."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value, dtype: str, np_dtype) -> grpcclient.InferInput:
        x = grpcclient.InferInput(name, [1, 1], dtype)
        x.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return x

    inputs = [tensor(DIT.PROMPT, prompt(i).encode(), "BYTES", np.object_),
              tensor(DIT.HEIGHT, size, "INT32", np.int32),
              tensor(DIT.WIDTH, size, "INT32", np.int32),
              tensor(DIT.NUM_INFERENCE_STEPS, steps, "INT32", np.int32),
              tensor(DIT.SEED, i, "INT64", np.int64)]
    with grpcclient.InferenceServerClient(url) as client:
        res = client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(output)],
                           timeout=timeout)
    return res.as_numpy(output)[0]
