"""The orchestrator's engine.json: which Triton models play which role, and how chunks flow.

Read in the orchestrator's stub at load time (and in tests); the repository
generator writes it from the pipeline spec. Unknown keys are an error.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve import env
from omni_serve.encoder.config import MediaLimits, VideoLimits
from omni_serve.families import DEFAULT as DEFAULT_FAMILY
from omni_serve.removed_settings import RefusesRemovedSettings

# The orchestrator's roles and the backend each must name (the stage's kind of work).
ROLE_BACKENDS = {
    "thinker": "omni_llm", "talker": "omni_talker", "image_encoder": "omni_encoder",
    "audio_encoder": "omni_encoder", "audio_decoder": "omni_audio",
    "image_generator": "omni_dit",
}
# Roles that may name a list of stages: engines the orchestrator routes between
# (session affinity, else the least busy; omni_serve.orchestrator.routing).
MULTI_STAGE_ROLES = frozenset({"thinker"})

Where = tuple[str | int, ...]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def role_problems(roles: Any) -> list[tuple[Where, str]]:
    """What is wrong with an orchestrator's `stages` mapping on its own: (key path, message)
    per problem. The one place these rules live: StageRoles raises them, and omni-gen-repo's
    spec check reports them with the spec's path (and checks the names against its stages)."""
    if not isinstance(roles, Mapping):
        return [((), f"required: a mapping of roles ({', '.join(ROLE_BACKENDS)}) to stage names")]
    problems: list[tuple[Where, str]] = []
    for role, target in roles.items():
        if role not in ROLE_BACKENDS:
            problems.append(((role,), f"unknown role; roles: {', '.join(ROLE_BACKENDS)}"))
        elif not isinstance(target, (list, tuple)):
            if target is not None and not isinstance(target, str):
                problems.append(((role,), f"must be a stage name (got {_short(target)})"))
        elif role not in MULTI_STAGE_ROLES:
            problems.append(((role,), f"one stage name (only the "
                                      f"{', '.join(sorted(MULTI_STAGE_ROLES))} role takes a list)"))
        elif not target:
            problems.append(((role,), f"an empty list; name at least one {ROLE_BACKENDS[role]} "
                                      "stage"))
        else:
            for i, item in enumerate(target):
                if not isinstance(item, str):
                    problems.append(((role, i), "must be a stage name" if item is None
                                     else f"must be a stage name (got {_short(item)})"))
                elif item in target[:i]:
                    problems.append(((role, i), f"stage {item!r} is named twice"))
    if "thinker" not in roles:
        problems.append((("thinker",), "required key is missing"))
    return problems


class StageRoles(BaseModel):
    """Triton model names of the stages; a missing role disables what needs it.

    `thinker` may name several omni_llm models (engines of the same
    checkpoint, possibly on several servers): a request with a session id
    goes to its session's engine (rendezvous hashing, so vLLM's prefix cache
    keeps the conversation), one without to the least busy engine
    (omni_serve.orchestrator.routing).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    thinker: str | tuple[str, ...]
    image_encoder: str | None = None
    audio_encoder: str | None = None
    talker: str | None = None
    audio_decoder: str | None = None
    image_generator: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _roles(cls, data: Any) -> Any:
        problems = role_problems(data)
        if problems:
            raise ValueError("; ".join(
                f"{'.'.join(map(str, where)) or 'stages'}: {message}" for where, message in problems))
        return data

    @field_validator("thinker")
    @classmethod
    def _thinkers(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        names = (value,) if isinstance(value, str) else value
        if any(not name for name in names):  # the rest is role_problems'
            raise ValueError("model names must not be empty")
        return value

    @property
    def thinkers(self) -> tuple[str, ...]:
        """The thinker engines' model names (one or more)."""
        return (self.thinker,) if isinstance(self.thinker, str) else self.thinker


SharedMemory = Literal["auto", "system", "none"]


# Measured (docs/benchmarks-notes.md, "one server vs two"): a region saves 20-60 ms
# per call for 16 MiB of mm_embeds but nothing at 0.5 MiB (its register RPC
# costs what the copy saves), and costs 3-6 ms at 13 KiB.
SHM_MIN_BYTES_DEFAULT = 1024 * 1024


class RemoteStage(BaseModel):
    """A stage served by another tritonserver (written by omni-gen-repo)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: str
    url: str | None = None  # OMNI_SERVER_<SERVER>_URL overrides it
    # Inputs of at least `shared_memory_min_bytes` (e.g. the thinker's mm_embeds)
    # go to the stage through Triton system shared memory instead of inside the
    # gRPC message: "system" always, "none" never, "auto" when the server's host
    # is this machine (loopback or this host's name or address).
    # OMNI_SERVER_<SERVER>_SHM overrides it.
    shared_memory: SharedMemory = "auto"
    shared_memory_min_bytes: int = Field(default=SHM_MIN_BYTES_DEFAULT, ge=1)

    def shared_memory_mode(self) -> SharedMemory:
        """`shared_memory`, or OMNI_SERVER_<SERVER>_SHM when set."""
        name = env.SERVER_SHM.named(name=self.server)
        value = (env.SERVER_SHM.get(name=self.server) or self.shared_memory).strip().lower()
        if value not in ("auto", "system", "none"):
            raise ValueError(f"{name}={value!r}: use auto, system or none")
        return value  # type: ignore[return-value]


class OrchestratorConfig(RefusesRemovedSettings):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Settings that are gone: engine.json and omni-gen-repo's spec check name what to do.
    REMOVED_SETTINGS: ClassVar[dict[str, str]] = {
        "transport": "removed: the stages are always called over Triton gRPC (this "
                     "server's own endpoint, `triton_url`, or the spec's `servers:` for "
                     "stages elsewhere); BLS crashed Triton 2.51's stub under load. "
                     "Delete the key",
        "mode": "removed: the orchestrator always pipelines (the talker starts on the "
                "thinker's first reply tokens, the decoder on the first codes); the "
                "stage-by-stage baseline is omni-bench pipelining's own. Delete the key",
        "speakers": "renamed to voices (docs/glossary.md: one name per concept)",
    }

    stages: StageRoles
    # The checkpoints' model family (omni_serve.families; omni-gen-repo writes it from the
    # thinker's config.json): its speech feed, and the defaults below that say "family's".
    # Stages are called over Triton gRPC: this server's own endpoint (read from
    # its command line) unless `triton_url` names another.
    triton_url: str | None = None
    # Stages on other servers, by model name.
    remote: dict[str, RemoteStage] = Field(default_factory=dict)
    # The thinker's tokenizer folder (omni-gen-repo writes it; the orchestrator needs
    # it): its chat template renders the thinker's prompts (orchestrator/prompt.py),
    # and task "speech" turns the text to read into token ids with it.
    tokenizer: str | None = None
    family: str = DEFAULT_FAMILY
    # The family's own (its model card's; a talker may speak only with it)
    system_prompt: str = ""
    # Thinker defaults (a request's sampling_parameters override them).
    thinker_sampling: dict[str, Any] = Field(default_factory=lambda: {"max_tokens": 64})
    # Speech: the talker's codes go to the audio decoder in chunks of
    # `chunk_codes` (the first `first_chunk_codes`; both default to the family's
    # `speech_chunks`, measured, else the values below) with at least
    # `left_context_codes` codes of left context aligned to `align_codes` and
    # `right_context_codes` of right context. omni-gen-repo sets the three from
    # the checkpoint (its family's `decoder_context`: for the default family the DiT's
    # block attention over one solver pass and BigVGAN's field), which keeps chunked
    # audio within ~93 dB of one whole decode on the tiny default; the defaults
    # here are those of the default family's largest checkpoint.
    # The talker's sampling defaults: the family's (its reference generate()'s); a
    # request's talker_sampling_parameters override them key by key.
    talker_sampling: dict[str, Any] = Field(default_factory=dict)
    # Voices: the checkpoint's voice names (omni-gen-repo reads them from the
    # audio checkpoint, as its family keeps them); None: not known here, a
    # request's voice goes to the stages as it is. `voice_map` maps other
    # names onto voices (matched case-insensitively; voice names match
    # exactly and come first): by default the family's map of OpenAI's voices,
    # so OpenAI apps that always send one get a voice of this checkpoint.
    voices: list[str] | None = None
    voice_map: dict[str, str] = Field(default_factory=dict)
    # Pipelined mode: decoder chunks in flight per request (Triton batches
    # them); audio still goes out in order.
    parallel_chunks: int = Field(default=4, ge=1)
    first_chunk_codes: int = Field(default=12, ge=1)
    # Chunks are smaller on a lighter server (orchestrator/pace.py): the first is
    # the fewest frames of at least `min_first_chunk_codes` (unset: `first_chunk_codes`,
    # always that size) that play for `first_chunk_margin` times what the second
    # chunk (`min_chunk_codes`; unset: `chunk_codes`) takes to make at the pace
    # measured so far; the later ones the most, up to `chunk_codes`, that are back
    # before the audio ahead of them has played. Only while at most
    # `first_chunk_pace_replies` speech replies are in flight on this instance.
    min_first_chunk_codes: int | None = Field(default=None, ge=1)
    first_chunk_margin: float = Field(default=1.0, gt=0)
    first_chunk_pace_replies: int = Field(default=4, ge=1)
    chunk_codes: int = Field(default=24, ge=1)
    min_chunk_codes: int | None = Field(default=None, ge=1)
    left_context_codes: int = Field(default=41, ge=0)
    right_context_codes: int = Field(default=40, ge=0)
    align_codes: int = Field(default=12, ge=1)
    # Image output: the DiT gets the thinker's reply as its prompt.
    image_size: int = Field(default=64, ge=16)
    image_steps: int = Field(default=4, ge=1)
    # A stage that sends nothing for this long fails the request (no hangs).
    stage_timeout_s: float = Field(default=120.0, gt=0)
    # Several thinker engines, or replicas of a stage server (orchestrator/replicas.py):
    # one that answered UNAVAILABLE before sending anything (server down, model
    # unloaded, silent past stage_timeout_s) gets no requests for this long; the
    # request goes on to the next engine or replica.
    engine_retry_after_s: float = Field(default=10.0, gt=0)
    # Stages on other servers: the orchestrator loads (so, on Triton 2.51, its
    # server is ready) only once each is ready on its server, or on one replica;
    # not within this long, its load fails naming them. 0: load without waiting.
    remote_ready_timeout_s: float = Field(default=900.0, ge=0)
    # Largest image or audio file a request may carry (bytes), checked before any stage runs.
    max_media_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    # Most audio items one request's thinker hears: its `history` turns' audio parts and
    # its `audio` (each within max_media_bytes).
    max_audio_items: int = Field(default=16, ge=1)
    # A clip's limits (bytes, seconds, frames, frame size), checked on its header before any
    # stage runs; the thinker checks the same (omni-gen-repo writes the spec's
    # `video_limits` to both).
    video_limits: VideoLimits = Field(default_factory=VideoLimits)

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        """system_prompt, voice_map, talker_sampling and the chunk sizes default to the family's."""
        if not isinstance(data, Mapping):
            return data
        from omni_serve import families

        family = families.get(data.get("family", DEFAULT_FAMILY))  # ValueError names the known
        data = dict(data)
        data.setdefault("system_prompt", family.system_prompt or "")
        data.setdefault("voice_map", dict(family.voice_map))
        data.setdefault("talker_sampling", dict(family.talker_sampling))
        for key, value in family.speech_chunks.items():
            data.setdefault(key, value)
        return data

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        speech = (self.stages.talker, self.stages.audio_decoder)
        if any(speech) and not all(speech):
            raise ValueError("stages.talker and stages.audio_decoder go together (speech needs both)")
        if any(speech) and self.speech is None:
            raise ValueError(f"stages.talker: model family {self.family!r} has no speech output")
        self._check_voices()
        return self

    def _check_voices(self) -> None:
        if self.voices is not None:
            if not self.voices or any(not s or s != s.strip() for s in self.voices):
                raise ValueError(f"voices={self.voices!r}: give the checkpoint's voice names "
                                 "(non-empty, no surrounding spaces), or leave it unset")
            if len(set(self.voices)) != len(self.voices):
                raise ValueError(f"voices={self.voices!r}: each name may appear once")
        seen: dict[str, str] = {}
        for alias, voice in self.voice_map.items():
            if not alias.strip() or not voice.strip():
                raise ValueError(f"voice_map: {alias!r} -> {voice!r}: names must not be empty")
            if alias.lower() in seen:
                raise ValueError(f"voice_map: {seen[alias.lower()]!r} and {alias!r} are the same "
                                 "alias (aliases match case-insensitively); keep one")
            seen[alias.lower()] = alias
            if self.voices is not None and voice not in self.voices:
                raise ValueError(f"voice_map: {alias!r} -> {voice!r}, which is not a voice of "
                                 f"the checkpoint ({', '.join(self.voices)}); map it to one of "
                                 "those, or set voice_map to {} to send names as they are")

    @property
    def clip_limits(self) -> MediaLimits:
        """The limits a clip is probed and its soundtrack read within: `video_limits`."""
        return MediaLimits().with_video(self.video_limits)

    @property
    def raw_media(self) -> tuple[str, ...]:
        """The modalities the family's thinker takes raw (no encoder stage)."""
        from omni_serve import families

        return families.get(self.family).raw_media

    @property
    def speech(self):
        """The family's SpeechFeed (None: a family with text out only)."""
        from omni_serve import families

        return families.get(self.family).speech

    def voice(self, name: str) -> str | None:
        """The voice `name` stands for: itself if a known voice, else its voice_map alias.

        None when `name` is neither (with `voices` unknown: `name` itself).
        """
        if self.voices is not None and name in self.voices:
            return name
        folded = {alias.lower(): voice for alias, voice in self.voice_map.items()}
        mapped = folded.get(name.lower())
        if mapped is not None:
            return mapped
        return name if self.voices is None else None

    def remote_url(self, model: str) -> str | None:
        """Where `model` is served when it is not on this server (env override first)."""
        stage = self.remote.get(model)
        if stage is None:
            return None
        url = env.SERVER_URL.get(name=stage.server) or stage.url
        if not url:
            raise ValueError(f"stage {model} is on server {stage.server}: set "
                             f"{env.SERVER_URL.named(name=stage.server)} or its grpc_url")
        return url

    @property
    def output_modalities(self) -> tuple[str, ...]:
        out = ["text"]
        if self.stages.talker:
            out.append("audio")
        if self.stages.image_generator:
            out.append("image")
        return tuple(out)
