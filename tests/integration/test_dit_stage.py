"""The text-to-image preset (omni_dit) in a real tritonserver, called with tritonclient."""
from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from omni_serve.contract import DIT

from .llm_io import metric

pytestmark = pytest.mark.integration
MODEL = "text_to_image"


def infer(url: str, prompt: str, *, seed: int = 0, height: int = 64, width: int = 64,
          steps: int = 2, raw: bool = True, step_cache: bool | None = None):
    def t(name, value, dtype, np_dtype):
        x = grpcclient.InferInput(name, [1, 1], dtype)
        x.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return x

    inputs = [t(DIT.PROMPT, prompt.encode(), "BYTES", np.object_),
              t(DIT.HEIGHT, height, "INT32", np.int32), t(DIT.WIDTH, width, "INT32", np.int32),
              t(DIT.NUM_INFERENCE_STEPS, steps, "INT32", np.int32),
              t(DIT.SEED, seed, "INT64", np.int64)]
    if step_cache is not None:
        inputs.append(t(DIT.STEP_CACHE, step_cache, "BOOL", np.bool_))
    outputs = [grpcclient.InferRequestedOutput(DIT.IMAGE)]
    if raw:
        outputs.append(grpcclient.InferRequestedOutput(DIT.IMAGE_RAW))
    with grpcclient.InferenceServerClient(url) as client:
        return client.infer(MODEL, inputs, outputs=outputs, timeout=120)


def png(result) -> Image.Image:
    return Image.open(io.BytesIO(result.as_numpy(DIT.IMAGE)[0][0]))


@pytest.fixture(scope="module")
def url(text_to_image_server):
    return text_to_image_server.grpc_url


def test_a_valid_png_of_the_requested_size_comes_back(url):
    res = infer(url, "a red fox in the snow", height=32, width=48)
    img = png(res)
    assert img.format == "PNG" and img.size == (48, 32) and img.mode == "RGB"
    raw = res.as_numpy(DIT.IMAGE_RAW)
    assert raw.shape == (1, 32, 48, 3) and raw.dtype == np.uint8
    assert np.array_equal(np.asarray(img), raw[0])


def test_concurrent_requests_are_batched_and_match_their_lone_images(url, text_to_image_server):
    prompts = [f"picture {i}: a {w}" for i, w in enumerate(["cat", "lighthouse at dusk",
                                                             "bowl of ripe figs", "ship"])]
    alone = [infer(url, p, seed=i).as_numpy(DIT.IMAGE_RAW) for i, p in enumerate(prompts)]
    before = metric(text_to_image_server.metrics(), "omni_dit_batch_size_count", MODEL)
    batched_sum0 = metric(text_to_image_server.metrics(), "omni_dit_batch_size_sum", MODEL)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda ip: infer(url, ip[1], seed=ip[0] % 4).as_numpy(DIT.IMAGE_RAW),
                                 list(enumerate(prompts * 2))))
    m = text_to_image_server.metrics()
    executions = metric(m, "omni_dit_batch_size_count", MODEL) - before
    assert metric(m, "omni_dit_batch_size_sum", MODEL) - batched_sum0 == 8
    assert executions < 8, "Triton's dynamic batcher grouped concurrent requests"
    for i, img in enumerate(together):
        diff = np.abs(img.astype(int) - alone[i % 4].astype(int)).max()
        assert diff <= 1, f"request {i} differs by {diff} from its lone image"
    assert not np.array_equal(alone[0], alone[1])


def test_a_bad_request_in_a_batch_fails_alone(url):
    def call(args):
        try:
            return infer(url, *args[:1], height=args[1])
        except InferenceServerException as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, [("ok one", 64), ("bad", 100), ("ok two", 64),
                                       ("too big", 4096)]))
    assert png(results[0]).size == (64, 64) and png(results[2]).size == (64, 64)
    assert isinstance(results[1], InferenceServerException)
    assert "height: must be a multiple of 16 between 16 and 512, got 100" in results[1].message()
    assert isinstance(results[3], InferenceServerException)
    assert "height" in results[3].message() and "4096" in results[3].message()
    assert png(infer(url, "still serving")).size == (64, 64)


@pytest.mark.parametrize("field,kw,expected", [
    ("num_inference_steps", dict(steps=0), "num_inference_steps"),
    ("num_inference_steps", dict(steps=51), "num_inference_steps"),
    ("width", dict(width=8), "width"),
    ("prompt", dict(prompt=""), "prompt"),
])
def test_limits_are_invalid_arg_errors_naming_the_field(url, field, kw, expected):
    prompt = kw.pop("prompt", "a lighthouse")
    with pytest.raises(InferenceServerException) as e:
        infer(url, prompt, **kw)
    assert e.value.message().startswith(expected), e.value.message()


def test_step_cache_is_switched_per_request_and_reported(url, text_to_image_server):
    def counters():
        m = text_to_image_server.metrics()
        return (metric(m, "omni_dit_cache_lookups_total", MODEL),
                metric(m, "omni_dit_cache_hits_total", MODEL))

    l0, h0 = counters()
    plain = infer(url, "a lighthouse", seed=3, steps=6, step_cache=False).as_numpy(DIT.IMAGE_RAW)
    l1, h1 = counters()
    assert (l1, h1) == (l0, h0), "an uncached request made cache lookups"
    cached = infer(url, "a lighthouse", seed=3, steps=6, step_cache=True).as_numpy(DIT.IMAGE_RAW)
    l2, h2 = counters()
    assert l2 - l1 == 6 and 0 <= h2 - h1 <= 5  # one decision per step; the first always computes
    assert cached.shape == plain.shape
    # the cache is off again afterwards: the uncached image is reproduced exactly
    again = infer(url, "a lighthouse", seed=3, steps=6, step_cache=False).as_numpy(DIT.IMAGE_RAW)
    assert np.array_equal(again, plain)


def test_mixed_sizes_in_one_batch_each_get_their_own_size(url):
    sizes = [(64, 64), (32, 48), (64, 64), (48, 32), (32, 48), (64, 32)]
    with ThreadPoolExecutor(len(sizes)) as pool:
        results = list(pool.map(lambda hw: infer(url, f"size {hw}", height=hw[0], width=hw[1]),
                                sizes))
    for (h, w), res in zip(sizes, results):
        assert png(res).size == (w, h)
        alone = infer(url, f"size {(h, w)}", height=h, width=w).as_numpy(DIT.IMAGE_RAW)
        assert np.abs(res.as_numpy(DIT.IMAGE_RAW).astype(int) - alone.astype(int)).max() <= 1


def test_perf_analyzer_measures_text_to_image(url, tmp_path):
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    data = {"data": [{DIT.PROMPT: ["a lighthouse at dusk"], DIT.HEIGHT: [32], DIT.WIDTH: [32],
                      DIT.NUM_INFERENCE_STEPS: [2], DIT.SEED: [7]}]}
    (tmp_path / "in.json").write_text(json.dumps(data))
    proc = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "perf_analyzer"), "-m", MODEL, "-i", "grpc", "-u", url,
         "--input-data", str(tmp_path / "in.json"), "--concurrency-range", "4",
         "--measurement-mode", "count_windows", "--measurement-request-count", "12",
         "-s", "1000", "-r", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"Throughput: ([\d.]+) infer/sec", proc.stdout)
    assert m and float(m.group(1)) > 0, proc.stdout
