"""The generator stages on a GPU against their references, without Triton or vLLM.

Where it runs: one plain Python process on a machine with a CUDA GPU and PyTorch
(`python -m omni_tools.gpu_stages`). tools/gpu_smoke.sh runs it where there is no
Triton build to serve with; it needs only torch, transformers, diffusers, pydantic
and this project's source.

What flows through it: the tiny random-weight checkpoints (omni_tools.tiny_models,
built on the CPU into the model cache), loaded by the stages' own runners
(omni_serve.audio for Qwen2.5-Omni's Token2Wav and Qwen3-Omni's Code2Wav,
omni_serve.dit for Qwen-Image) with `device="cuda"`, and by the reference
implementations (transformers, diffusers) on the CPU, as the served goldens compare
them. Each check prints the largest difference of the stage on the GPU and, as the
baseline, of the same stage on the CPU, both against the reference; the exit status
is 1 when a stage fails to run on the GPU or is off by more than its tolerance.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import AudioRequest
from omni_serve.audio.runner import AudioRunner
from omni_serve.dit.config import DitStageConfig
from omni_serve.dit.request import DitRequest
from omni_serve.dit.runner import DitRunner, to_uint8
from omni_tools import tiny_models as tm


@dataclass
class Check:
    name: str
    tolerance: float
    unit: str
    run: Callable[[str], np.ndarray]  # device -> the stage's output
    reference: Callable[[], np.ndarray]  # the reference implementation's output, on the CPU


def qwen25_token2wav(frames: int = 60, seed: int = 23) -> Check:
    from transformers import Qwen2_5OmniForConditionalGeneration

    ckpt = tm.ensure_model("qwen2.5-omni-tiny")
    codes = np.random.default_rng(0).integers(0, 256, (frames, 1))

    def run(device: str) -> np.ndarray:
        runner = AudioRunner(AudioStageConfig(model=str(ckpt), device=device, max_codec_tokens=128))
        return runner.run([AudioRequest(codes=codes, context=0, voice="Chelsie", seed=seed)])[0]

    def reference() -> np.ndarray:
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(ckpt).eval()
        voice = torch.load(ckpt / "spk_dict.pt", weights_only=True)["Chelsie"]
        torch.manual_seed(seed)
        with torch.inference_mode():
            return model.token2wav(torch.from_numpy(codes[None, :, 0]), conditioning=voice["cond"],
                                   reference_mel=voice["ref_mel"]).numpy()

    return Check("qwen2.5-omni Token2Wav (omni_audio)", 1e-4, "samples", run, reference)


def qwen3_code2wav(frames: int = 50) -> Check:
    from transformers import AutoConfig, Qwen3OmniMoeForConditionalGeneration

    ckpt = tm.ensure_model("qwen3-omni-tiny")
    codec = AutoConfig.from_pretrained(ckpt).code2wav_config
    codes = np.random.default_rng(0).integers(0, codec.codebook_size,
                                              (frames, codec.num_quantizers))

    def run(device: str) -> np.ndarray:
        runner = AudioRunner(AudioStageConfig(model=str(ckpt), device=device))
        return runner.run([AudioRequest(codes=codes, context=0, voice=None, seed=0)])[0]

    def reference() -> np.ndarray:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt).eval()
        with torch.inference_mode():
            return model.code2wav(torch.from_numpy(codes.T[None].copy()))[0, 0].numpy()

    return Check("qwen3-omni Code2Wav (omni_audio)", 1e-4, "samples", run, reference)


def qwen_image(seed: int = 1) -> Check:
    from diffusers import DiffusionPipeline

    ckpt = tm.ensure_model("qwen-image-tiny")
    prompt, side, steps = "a red cat", 64, 2

    def run(device: str) -> np.ndarray:
        runner = DitRunner(DitStageConfig(model=str(ckpt), device=device))
        req = DitRequest(prompt=prompt, negative_prompt=None, height=side, width=side,
                         num_inference_steps=steps, guidance_scale=4.0, seed=seed)
        return runner.run([req])[0].astype(np.int16)

    def reference() -> np.ndarray:
        pipe = DiffusionPipeline.from_pretrained(ckpt)
        pipe.set_progress_bar_config(disable=True)
        with torch.inference_mode():
            images = pipe(prompt=[prompt], height=side, width=side, num_inference_steps=steps,
                          generator=[torch.Generator().manual_seed(seed)], output_type="np").images
        return to_uint8(images)[0].astype(np.int16)

    return Check("qwen-image DiT (omni_dit)", 1, "uint8 levels", run, reference)


CHECKS = {"token2wav": qwen25_token2wav, "code2wav": qwen3_code2wav, "dit": qwen_image}


def largest_difference(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        raise ValueError(f"shape {list(got.shape)}, the reference's {list(want.shape)}")
    return float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", nargs="*", help=f"of {', '.join(CHECKS)} (default: all)")
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"],
                        help="where the stages run; cpu is the baseline (default: cpu cuda)")
    args = parser.parse_args(argv)
    if unknown := set(args.checks) - set(CHECKS):
        parser.error(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    if "cuda" in args.devices and not torch.cuda.is_available():
        print("gpu_stages: torch sees no CUDA device", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"gpu_stages: {gpu}, torch {torch.__version__}, TF32 by default in matmuls "
          f"{torch.backends.cuda.matmul.allow_tf32}, in cuDNN {torch.backends.cudnn.allow_tf32}")
    failed = 0
    for key in args.checks or CHECKS:
        line = [key]
        try:
            check = CHECKS[key]()
            want = check.reference()
            line = [f"{check.name}: tolerance {check.tolerance:g} {check.unit}"]
            for device in args.devices:
                start = time.perf_counter()
                got = check.run(device)
                ms = (time.perf_counter() - start) * 1e3
                diff = largest_difference(got, want)
                ok = diff <= check.tolerance
                failed += not ok
                line.append(f"{device}: max |stage - reference| {diff:.3g} "
                            f"({'ok' if ok else 'OFF'}; load+run {ms:.0f} ms)")
        except Exception as e:  # each check reports its own failure; the rest go on
            failed += 1
            line.append(f"FAILED: {type(e).__name__}: {e}")
        print("; ".join(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
