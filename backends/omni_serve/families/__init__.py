"""Model families: what differs between omni model families, behind one seam (any process).

A family (Qwen2.5-Omni today, Qwen3-Omni next) is one folder here that
registers a `Family`: which checkpoints it serves (their config.json
`model_type`), what each stage role reads of the checkpoint folder, its
default system prompt, its thinker's media-token accounting (`MediaTokens`),
its `SpeechFeed` (how the orchestrator feeds the family's talker and audio
decoder), and, by import path, the stage-side code each stage kind loads in
its own process: the thinker's vLLM classes, the talker's side, the media
encoders (`MediaEncoder`) and the codec decoder (`CodecDecoder`) with its
chunk context. The generator picks the family from the checkpoint
(`for_config`) and writes its name into the orchestrator's engine.json; the
orchestrator asks `get(name)`; the talker, encoder and audio stages ask
`for_checkpoint(folder)`. Nothing outside this package branches on a family;
adding one adds a folder and a line in `_BUILTIN`.

What flows through a SpeechFeed (orchestrator's event loop): the thinker's
streamed responses gathered in a `ThinkerReply`, the talker's codes as
`[frames, groups]` arrays, and decoder chunks of frames with their context.
"""
from __future__ import annotations

import importlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from omni_serve.audio.config import AudioStageConfig
    from omni_serve.audio.request import AudioRequest, ChunkContext
    from omni_serve.encoder.runner import EncoderOutput

# the families this package ships, by import path (each registers itself)
_BUILTIN = ("omni_serve.families.qwen2_5_omni", "omni_serve.families.qwen3_omni_moe")
# the family of an orchestrator config that names none (the first one the project served)
DEFAULT = "qwen2_5_omni"


@dataclass
class ThinkerReply:
    """What the thinker's responses told so far, for the talker (filled by the orchestrator).

    `file`: where the thinker keeps its rows (hidden_states_in_shm), `prompt_ids`:
    its prompt as its engine saw it, `reply_ids`: the reply's token ids so far.
    """

    file: str | None = None
    prompt_ids: list[int] | None = None
    reply_ids: list[int] = field(default_factory=list)
    reply_tokens: int = 0


@dataclass(frozen=True)
class DecoderChunk:
    """One audio decoder request: `frames` [n, groups] = left context + voiced + right context."""

    frames: np.ndarray
    context: int  # leading frames that are context only
    lookahead: int  # trailing frames that are right context only
    offset: int  # stream position of frames[0]
    end: int  # stream position after the last frame voiced


class SpeechFeed(Protocol):
    """How the orchestrator drives a family's talker and audio decoder."""

    codec_groups: int  # codes per frame
    thinker_inputs: Mapping[str, np.ndarray]  # what the thinker must return for the talker
    thinker_outputs: tuple[str, ...]  # the thinker outputs the talker's feed reads

    def talker_ready(self, reply: ThinkerReply) -> bool:
        """Whether the talker can start on what the thinker has sent so far."""
        ...

    def talker_inputs(self, reply: ThinkerReply, media: Mapping[str, np.ndarray],
                      voice: str | None, sampling: dict[str, Any]) -> dict[str, np.ndarray]:
        """The talker request's input tensors."""
        ...

    def decoder_inputs(self, chunk: DecoderChunk, seed: int,
                       voice: str | None) -> dict[str, np.ndarray]:
        """One audio decoder request's input tensors."""
        ...


class MediaTokens(Protocol):
    """The thinker's media-token accounting: how many prompt tokens (embedding rows) a media
    item becomes. Read by the encoder stage (each item's `tokens`) and by the thinker stage
    (what it refuses before the engine); plain arithmetic, no model loaded."""

    def image_tokens(self, grid_thw: Sequence[int], merge: int) -> int:
        """Rows of one image of patch grid (t, h, w) after the vision tower's `merge` x `merge` merge."""
        ...

    def audio_tokens(self, frames: int) -> int:
        """Rows of one clip of `frames` feature frames (0: too short for one)."""
        ...


class MediaEncoder(Protocol):
    """One modality of the encoder stage's family side (omni_serve.encoder.runner drives it).

    `Family.encoders` names a loader `load(cfg: EncoderStageConfig) -> MediaEncoder` for
    `cfg.modality` ("image": a PIL RGB image per item; "audio": float32 mono samples at
    `cfg.sample_rate`), which raises ValueError naming what the checkpoint cannot serve.
    """

    def prepare(self, media: Any) -> Any:
        """One decoded item -> what `encode` takes; RequestError("media", ...) for one it cannot
        take (it fails alone)."""
        ...

    def encode(self, items: list[Any]) -> list[EncoderOutput]:
        """The thinker's inputs of prepared items, in one forward where the modality has a tower
        (the stage retries one by one when it raises)."""
        ...


class CodecDecoder(Protocol):
    """The audio decoder stage's family side: codec frames -> waveform (omni_serve.audio.runner).

    `Family.decoder` names the class; the stage calls `load(cfg)` once, then `decode` from
    several threads, one call at a time, on groups of requests with the same frame count and
    `batch_key`. A request's codes are [frames, codec_groups] int64 (omni_serve.audio.request:
    `context` leading and `lookahead` trailing frames are context; `offset` is the stream
    position of frame 0; `voice` is one of `voices`, None for a decoder without).
    """

    sample_rate: int
    samples_per_frame: int  # waveform samples per codec frame
    codec_groups: int  # codes per frame
    codec_vocab: int  # codes are ids in [0, codec_vocab)
    voices: tuple[str, ...]  # () for a decoder without voices (its talker speaks them)
    default_voice: str | None
    max_frames: int | None  # the longest utterance it can place; None: no limit
    context: ChunkContext  # what a chunk needs around it to sound as the whole utterance
    # optional: leading samples of an utterance's audio that are no part of it (a causal
    # decoder's delay); the stage drops them from the chunk voiced from frame 0 (default 0)
    lead_samples: int

    @classmethod
    def load(cls, cfg: AudioStageConfig) -> CodecDecoder:
        """The decoder of the checkpoint folder `cfg.model` (ValueError / FileNotFoundError
        naming what does not fit; sampler settings it has no use for are an error)."""
        ...

    def batch_key(self, request: AudioRequest) -> Hashable:
        """Requests with equal frame counts and equal keys decode in one call."""
        ...

    def decode(self, group: list[AudioRequest]) -> np.ndarray:
        """float32 [len(group), frames * samples_per_frame] in [-1, 1], context frames included
        (the stage keeps the voiced ones)."""
        ...


@dataclass(frozen=True)
class Family:
    name: str  # the registry key, written into the orchestrator's engine.json
    title: str  # what users call it, e.g. "Qwen2.5-Omni"
    model_types: tuple[str, ...]  # config.json model_type of its checkpoints
    # what each stage role reads of the checkpoint folder: (tensor prefix, files)
    parts: Mapping[str, tuple[str, tuple[str, ...]]]
    system_prompt: str | None = None  # the family's default (its model card's)
    # stage-side classes, by import path ("module:Class"; loaded only where they run):
    # checkpoint architecture -> the vLLM model class (llm/vllm_models.py registers them)
    vllm_models: Mapping[str, str] = field(default_factory=dict)
    # the talker stage's family side (talker/stage.py: TalkerSide)
    talker: str | None = None
    # the encoder stage's: a loader `load(EncoderStageConfig) -> MediaEncoder`
    encoders: str | None = None
    # the modalities the thinker takes raw (its own vLLM processor and towers; no encoder
    # stage): the orchestrator sends their files to the thinker's `image` / `audio` / `video`
    # inputs
    raw_media: tuple[str, ...] = ()
    # where raw media's shapes come from for the talker's positions (orchestrator process):
    # `load(checkpoint folder)` -> an object whose `shapes(kind, file bytes)` returns
    # {image_grid_thw: [1, 3]} or {audio_feature_lengths: [1]}
    raw_media_shapes: str | None = None
    # the audio decoder stage's: a `CodecDecoder` class
    decoder: str | None = None
    # the decoder's chunk context from the checkpoint's config.json, no weights read
    # (`(config) -> ChunkContext | None`; omni-gen-repo writes it into the orchestrator's
    # engine.json)
    decoder_context: str | None = None
    # plain objects, any process:
    # the thinker's media-token accounting (encoder and thinker stages)
    media_tokens: MediaTokens | None = None
    # other voice names (OpenAI's) onto the family's voices, the orchestrator's default
    voice_map: Mapping[str, str] = field(default_factory=dict)
    # the talker's sampling defaults (its reference generate()'s), the orchestrator's default
    talker_sampling: Mapping[str, Any] = field(default_factory=dict)
    # the orchestrator's default decoder chunk sizes in talker steps (`first_chunk_codes`,
    # `min_first_chunk_codes`, `chunk_codes`), chosen by measurement (omni-bench
    # first-chunk); the config's own defaults where a family has none
    speech_chunks: Mapping[str, int] = field(default_factory=dict)
    speech: SpeechFeed | None = None
    # how its reference processor samples and sizes a clip's frames
    # (omni_serve.encoder.video.VideoSampling; None: the family takes no video)
    video: Any = None


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the registry (a second family with the same name or model type is an error)."""
    _load_builtin()
    return _add(family)


def _add(family: Family) -> Family:
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    taken = {t: f.name for f in _FAMILIES.values() if f is not family for t in f.model_types}
    clash = [t for t in family.model_types if t in taken]
    if clash:
        raise ValueError(f"model_type {clash[0]!r} is already served by family {taken[clash[0]]!r}")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family (tests register made-up ones)."""
    _FAMILIES.pop(name, None)


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for path in _BUILTIN:
            _add(importlib.import_module(path).FAMILY)


def supported() -> str:
    """`qwen2_5_omni (Qwen2.5-Omni: model_type qwen2_5_omni, ...)`, for error messages."""
    _load_builtin()
    return "; ".join(f"{f.name} ({f.title}: model_type {', '.join(f.model_types)})"
                     for f in sorted(_FAMILIES.values(), key=lambda f: f.name))


def get(name: str) -> Family:
    _load_builtin()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; supported: {supported()}") from None


def all_families() -> list[Family]:
    _load_builtin()
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def load(path: str) -> Any:
    """The object at "module:attribute"."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def for_checkpoint(folder: str) -> Family:
    """The family of the checkpoint in `folder` (its config.json)."""
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from e
    return for_config(config)


def for_config(config: Mapping[str, Any]) -> Family:
    """The family of a checkpoint's config.json (its model_type, or its thinker's)."""
    _load_builtin()
    model_type = config.get("model_type")
    thinker = config.get("thinker_config") or {}
    for family in _FAMILIES.values():
        if model_type in family.model_types or thinker.get("model_type") in family.model_types:
            return family
    raise ValueError(f"model_type {model_type!r} is not a model family this server serves; "
                     f"supported: {supported()}")
