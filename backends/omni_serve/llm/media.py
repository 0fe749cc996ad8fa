"""A multimodal prompt's media -> vLLM's `multi_modal_data` (runs in the omni_llm stub).

The thinker engine is vLLM's model of the checkpoint's family. It expands
each `<|IMAGE|>` / `<|AUDIO|>` placeholder of the prompt to one token per row
and gives the tokens the model's M-RoPE positions. Images arrive as the
vision tower's rows (the image encoder stage ran it) with their patch grids;
audio arrives as log-mel features (the engine runs the audio tower).

Every shape is checked here against the checkpoint, and each item's prompt
tokens are counted as the family counts them (omni_serve.families:
`MediaTokens`), so a malformed request is an INVALID_ARG naming its field,
never an error inside the engine (which would kill it for every request).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omni_serve import families
from omni_serve.contract import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, LLM
from omni_serve.errors import RequestError
from omni_serve.families import MediaTokens
from omni_serve.llm.request import Media

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MediaShapes:
    """What the checkpoint's towers take and give, and how its family counts media tokens."""

    hidden_size: int  # rows' width: the text model's hidden size
    merge: int  # vision spatial_merge_size: rows per image = t * h * w / merge**2
    mel_bins: int  # the audio tower's input
    tokens: MediaTokens  # the family's accounting

    @classmethod
    def from_hf_config(cls, config: Any) -> MediaShapes | None:
        """None for a model without both towers (a text-only LLM), or of no model family."""
        thinker = getattr(config, "thinker_config", config)
        vision = getattr(thinker, "vision_config", None)
        audio = getattr(thinker, "audio_config", None)
        if vision is None or audio is None:
            return None
        model_types = {"model_type": getattr(config, "model_type", None),
                       "thinker_config": {"model_type": getattr(thinker, "model_type", None)}}
        try:
            family = families.for_config(model_types)
        except ValueError as e:
            log.warning("media inputs are off: %s", e)
            return None
        if family.media_tokens is None:
            log.warning("media inputs are off: model family %s counts no media tokens", family.name)
            return None
        text = getattr(thinker, "text_config", thinker)
        return cls(int(text.hidden_size), int(vision.spatial_merge_size), int(audio.num_mel_bins),
                   family.media_tokens)


def video_sampling(config: Any) -> Any:
    """How the checkpoint's model family samples a clip's frames (VideoSampling), None for a
    model with no vision tower or of no family that takes video."""
    thinker = getattr(config, "thinker_config", config)
    if getattr(thinker, "vision_config", None) is None:
        return None
    model_types = {"model_type": getattr(config, "model_type", None),
                   "thinker_config": {"model_type": getattr(thinker, "model_type", None)}}
    try:
        return families.for_config(model_types).video
    except ValueError:
        return None


def multi_modal_data(media: Media, prompt: str, shapes: MediaShapes | None,
                     stage: str) -> dict[str, Any]:
    """vLLM's `multi_modal_data` for `prompt`; RequestError on anything that does not fit."""
    import torch

    if shapes is None:
        field = LLM.IMAGE_EMBEDS if media.image_embeds is not None else LLM.AUDIO_FEATURES
        raise RequestError(field, f"stage {stage} serves a text-only model")
    data: dict[str, Any] = {}
    if media.image_embeds is not None:
        rows, hidden = media.image_embeds.shape
        if hidden != shapes.hidden_size:
            raise RequestError(LLM.IMAGE_EMBEDS, f"rows must be {shapes.hidden_size} wide (the "
                                                 f"model's hidden size), got {hidden}")
        grid = media.image_grid_thw
        m = shapes.merge
        for t, h, w in grid.tolist():
            if h % m or w % m:
                # vLLM places an image's rows on a (t, h / merge, w / merge) grid: any
                # other grid kills its engine (no positions) or misplaces the rows
                raise RequestError(LLM.IMAGE_GRID_THW, f"each image's h and w must be multiples of "
                                                       f"the vision merge size {m}, got {[t, h, w]}")
        want = sum(shapes.tokens.image_tokens(thw, m) for thw in grid.tolist())
        if rows != want:
            raise RequestError(LLM.IMAGE_EMBEDS, f"has {rows} rows but {LLM.IMAGE_GRID_THW} "
                                                 f"{grid.tolist()} makes {want}")
        _placeholders(prompt, IMAGE_PLACEHOLDER, len(grid), LLM.IMAGE_GRID_THW, "images")
        data["image"] = {"image_embeds": torch.from_numpy(media.image_embeds),
                         "image_grid_thw": torch.from_numpy(grid)}
    if media.audio_features is not None:
        bins = media.audio_features.shape[0]
        if bins != shapes.mel_bins:
            raise RequestError(LLM.AUDIO_FEATURES, f"must have {shapes.mel_bins} mel bins (rows), "
                                                   f"got {bins}")
        lengths = media.audio_feature_lengths
        short = [int(n) for n in lengths if shapes.tokens.audio_tokens(int(n)) < 1]
        if short:
            raise RequestError(LLM.AUDIO_FEATURE_LENGTHS, f"each clip needs at least "
                                                          f"{min_audio_frames(shapes.tokens)} frames "
                                                          f"(one audio token), got {short[0]}")
        _placeholders(prompt, AUDIO_PLACEHOLDER, len(lengths), LLM.AUDIO_FEATURE_LENGTHS, "clips")
        mask = torch.arange(int(lengths.max()))[None, :] < torch.from_numpy(lengths)[:, None]
        data["audio"] = {"input_audio_features": torch.from_numpy(media.audio_features),
                         "audio_feature_lengths": torch.from_numpy(lengths),
                         "feature_attention_mask": mask.long()}
    for placeholder, kind in ((IMAGE_PLACEHOLDER, "image"), (AUDIO_PLACEHOLDER, "audio")):
        if kind not in data and placeholder in prompt:
            raise RequestError(LLM.TEXT_INPUT, f"has {placeholder} but no {kind} was sent")
    return data


def min_audio_frames(tokens: MediaTokens, most: int = 10_000) -> int:
    """The shortest clip (feature frames) that gives one audio token."""
    return next((n for n in range(1, most) if tokens.audio_tokens(n) >= 1), most)


def _placeholders(prompt: str, token: str, items: int, field: str, what: str) -> None:
    found = prompt.count(token)
    if found != items:
        raise RequestError(field, f"names {items} {what} but {LLM.TEXT_INPUT} has {found} "
                                  f"{token} placeholders (one per item)")
