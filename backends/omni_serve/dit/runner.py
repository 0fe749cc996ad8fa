"""The omni_dit pipeline runner (runs inside the Triton stub and in tests).

Flow: Triton's dynamic batcher hands the adapter a list of parsed
`DitRequest`s; `DitRunner.run` groups them by `group_key`, runs each group as
one batched diffusers call (one seeded generator per request, so a request's
image does not depend on its batch-mates) and returns one uint8 HxWx3 image
or one exception per request, in request order.
"""
from __future__ import annotations

import contextlib
import io
import logging
import threading

import numpy as np
import torch
from PIL import Image

from omni_serve.batching import run_grouped
from omni_serve.dit.config import DitStageConfig
from omni_serve.dit.request import DitRequest, group_key
from omni_serve.torch_setup import configure_torch

logger = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class DitRunner:
    """Owns one diffusers text-to-image pipeline; `run` is safe to call from several threads."""

    def __init__(self, cfg: DitStageConfig):
        from diffusers import DiffusionPipeline

        self.cfg = cfg
        # Step-cache decisions so far: "lookups" (transformer forwards with the
        # cache on) and "hits" (forwards that reused the cached residual).
        self.cache_stats = {"lookups": 0, "hits": 0}
        configure_torch(cfg.torch_threads, cfg.device, cfg.dtype)
        self.pipe = DiffusionPipeline.from_pretrained(cfg.model, dtype=TORCH_DTYPES[cfg.dtype])
        self.pipe.to(cfg.device)
        self.pipe.set_progress_bar_config(disable=True)
        self._lock = threading.Lock()
        # Pipelines silently resize sides that are not multiples of this (vae_scale_factor * 2).
        multiple = getattr(self.pipe, "vae_scale_factor", 8) * 2
        if cfg.side_multiple % multiple:
            raise ValueError(f"side_multiple={cfg.side_multiple} must be a multiple of {multiple} "
                             f"(vae_scale_factor * 2 of {type(self.pipe).__name__}); set side_multiple "
                             f"to {multiple} or a multiple of it")

    def run(self, requests: list[DitRequest]) -> list[np.ndarray | Exception]:
        """One uint8 HxWx3 image or the exception that request raised, per request, in order."""
        return run_grouped(requests, group_key, self._call, label="omni_dit")

    def _call(self, group: list[DitRequest]) -> np.ndarray:
        """One batched pipeline call for requests with equal `group_key`s -> uint8 (B, H, W, 3)."""
        first = group[0]
        has_negative = first.negative_prompt is not None
        kwargs = {}
        if has_negative:
            kwargs["negative_prompt"] = [r.negative_prompt for r in group]
        with self._lock, torch.inference_mode(), self._step_cache(first.step_cache):
            images = self.pipe(
                prompt=[r.prompt for r in group],
                height=first.height,
                width=first.width,
                num_inference_steps=first.num_inference_steps,
                true_cfg_scale=first.guidance_scale if has_negative else 1.0,
                generator=[torch.Generator().manual_seed(r.seed) for r in group],
                output_type="np",
                **kwargs,
            ).images
        return to_uint8(images)


    @contextlib.contextmanager
    def _step_cache(self, on: bool):
        """FirstBlockCache on the transformer for one call; always off (and reset) after.

        The skip decision is taken for the whole batch, so with the cache on a
        request's image can depend on its batch-mates (cache off: it cannot).
        """
        if not on:
            yield
            return
        from diffusers.hooks import FirstBlockCacheConfig

        transformer = self.pipe.transformer
        transformer.enable_cache(FirstBlockCacheConfig(threshold=self.cfg.cache_threshold))
        self._count_cache_decisions(transformer)
        try:
            yield
        finally:
            transformer.disable_cache()

    def _count_cache_decisions(self, transformer) -> None:
        """Count the head block's compute/skip decisions into `cache_stats` (this call's hook)."""
        from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

        for module in transformer.modules():
            registry = getattr(module, "_diffusers_hook", None)
            hook = registry.get_hook(_FBC_LEADER_BLOCK_HOOK) if registry is not None else None
            if hook is None:
                continue
            decide = hook._should_compute_remaining_blocks

            def counted(residual, decide=decide):
                compute = decide(residual)
                self.cache_stats["lookups"] += 1
                self.cache_stats["hits"] += 0 if compute else 1
                return compute

            hook._should_compute_remaining_blocks = counted
            return


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Float images in [0, 1] -> uint8, rounded as diffusers' `numpy_to_pil` does."""
    return (np.clip(images, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_png(arr: np.ndarray) -> bytes:
    """A uint8 HxWx3 RGB image as PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()
