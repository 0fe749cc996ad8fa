"""Qwen3-Omni's talker prompt, per-step text ids and engine arguments (omni_talker stub process).

The talker stage serves the checkpoint's own talker (families/qwen3_omni_moe/talker_model.py)
from the whole Qwen3-Omni folder. What a talker request needs is token ids: the thinker's
prompt (`prompt_ids`, as its engine saw it) and its reply (`reply_ids`). `TalkerPrompter`
builds the prefill as transformers' `Qwen3OmniMoeForConditionalGeneration.generate` does:

    user turns (every token from a user turn's <|im_start|> to the next one), in order:
        text rows:  text_projection(thinker input embedding)
        media rows: hidden_projection(thinker hidden state after layer accept_hidden_layer)
    the assistant turn (A = its tokens, <|im_start|> on, then the reply but its last token):
        A[0..2]  text_projection(embed(A[i]))
        3..6     tts_pad row + codec nothink, think_bos, think_eos, the voice's speaker id
        7        tts_bos row + codec pad
        8        text_projection(embed(A[3])) + codec bos

and the decode steps' text ids (`trailing_text_ids`: A[4:], then tts_eos, then tts_pad for
ever), which travel to the engine feed (families/qwen3_omni_moe/talker_engine.py) with the
codes file the worker writes each frame's residual codes to, and, for a prompt with media,
the talker's M-RoPE positions from transformers' own `get_rope_index` over the talker's
ids (the user turns', then tts_pad for the assistant rows).
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from omni_serve.contract import TALKER
from omni_serve.errors import RequestError
from omni_serve.families.checkpoint_tensors import read_rows, read_tensors, shards
from omni_serve.families.qwen3_omni_moe import talker_engine
from omni_serve.families.talker_generation import with_talker_stops
from omni_serve.llm import hidden_states
from omni_serve.talker.request import TalkerInput

ARCHITECTURE = "Qwen3OmniTalkerForConditionalGeneration"  # what the vLLM registry knows it by
MODEL_CLASS = "omni_serve.families.qwen3_omni_moe.talker_model:Qwen3OmniTalker"
THINKER_EMBED = "thinker.model.embed_tokens.weight"
CODEC_EMBED = "talker.model.codec_embedding.weight"
# transformers' Qwen3OmniMoeForConditionalGeneration.generate talker defaults
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05, "max_tokens": 4096,
}
SUPPRESSED_TOP_IDS = 1024  # transformers never samples the top 1024 codec ids but codec eos


def engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments of a talker stage (the checkpoint folder as `model`).

    vLLM sizes prompt embeddings, logits and sampling masks from the text config, which
    for Qwen3-Omni is the thinker's: its shape fields are set to the talker decoder's.
    Its generation config holds the talker's own stop code (families/talker_generation.py).
    """
    overrides = dict(args.get("hf_overrides") or {})
    overrides["architectures"] = [ARCHITECTURE]
    config = json.loads((Path(args["model"]) / "config.json").read_text())
    text = config.get("talker_config", {}).get("text_config", {})
    shape = {k: text[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "head_dim")
             if k in text}
    overrides["thinker_config"] = {"text_config": shape}
    eos = config.get("talker_config", {}).get("codec_eos_token_id")
    return with_talker_stops(args, {
        **args,
        "hf_overrides": overrides,
        "enable_prompt_embeds": True,
        "skip_tokenizer_init": True,
        # a cached block would skip the per-step inputs of another request
        "enable_prefix_caching": False,
        "async_scheduling": False,
        # the scheduler holds back requests whose next frame's text is not there yet
        "scheduler_cls": talker_engine.SCHEDULER,
        "worker_extension_cls": talker_engine.EXTENSION,
    }, [] if eos is None else [eos])


def assistant_start(prompt_ids: list[int], config) -> int:
    """Index of the last `<|im_start|>assistant` of the thinker's prompt."""
    for i in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[i] == config.im_start_token_id and prompt_ids[i + 1] == config.assistant_token_id:
            return i
    raise ValueError("the thinker prompt has no <|im_start|>assistant turn")


def user_positions(prompt_ids: list[int], config) -> list[int]:
    """Positions of the user turns (from a user <|im_start|> up to the next <|im_start|>)."""
    out, in_user = [], False
    for i, token in enumerate(prompt_ids):
        if token == config.im_start_token_id:
            in_user = i + 1 < len(prompt_ids) and prompt_ids[i + 1] == config.user_token_id
        if in_user:
            out.append(i)
    return out


def assistant_ids(prompt_ids: list[int], reply_ids: list[int], config) -> list[int]:
    """The assistant turn as the thinker fed it: <|im_start|> on, the reply's last token left out."""
    return prompt_ids[assistant_start(prompt_ids, config):] + list(reply_ids[:-1])


def trailing_text_ids(prompt_ids: list[int], reply_ids: list[int], config) -> list[int]:
    """The thinker ids of the decode steps' text rows: entry j is decode step j's (tts_pad after)."""
    ids = assistant_ids(prompt_ids, reply_ids, config)[4:] + [config.tts_eos_token_id]
    ends = [j for j, t in enumerate(reply_ids) if t == config.im_end_token_id]
    eos = ends[0] if ends else len(reply_ids)
    # entry j holds reply token j + 1: the marker goes right after the reply's first eos
    return [config.tts_pad_token_id if j > eos else config.tts_eos_token_id if j == eos else t
            for j, t in enumerate(ids)]


def _tensors(folder: Path, names: list[str]) -> dict:
    """The checkpoint tensors `names`, as float32."""
    import torch

    return {name: t.to(torch.float32) for name, t in read_tensors(shards(folder, names), names).items()}


class _WithAudioConfig:
    """The talker config, plus the thinker's `audio_config`."""

    def __init__(self, talker, audio_config):
        self._talker, self.audio_config = talker, audio_config

    def __getattr__(self, name: str):
        return getattr(self._talker, name)


class _RopeIndex:
    """transformers' Qwen3-Omni `get_rope_index`, bound to the talker config.

    For audio beside an image or video it reads `config.audio_config.n_window`, which the
    talker's config lacks (transformers 5.19's own talker raises AttributeError there):
    it gets the thinker's, the audio encoder that made those rows, so the talker's
    positions are the thinker's."""

    def __init__(self, config, audio_config):
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

        base = m.Qwen3OmniMoePreTrainedModelForConditionalGeneration
        self.config = _WithAudioConfig(config, audio_config)
        self.spatial_merge_size = config.spatial_merge_size
        self._index = base.get_rope_index.__get__(self)
        self.get_llm_pos_ids_for_vision = base.get_llm_pos_ids_for_vision.__get__(self)

    def __call__(self, ids: list[int], media: dict[str, Any]) -> tuple[np.ndarray, int]:
        import torch

        def tensor(name):
            value = media.get(name)
            return None if value is None else torch.as_tensor(np.asarray(value))

        input_ids = torch.tensor([ids])
        pos, delta = self._index(input_ids, tensor("image_grid_thw"), tensor("video_grid_thw"),
                                 torch.ones_like(input_ids), bool(media.get("use_audio_in_video")),
                                 tensor("audio_feature_lengths"), tensor("video_second_per_grid"))
        return pos[:, 0].numpy().astype(np.int64), int(delta.reshape(-1)[0])


class TalkerPrompter:
    """The talker stage's Qwen3-Omni side: prompts, text ids and sampling; one per stage."""

    codec_groups = 16
    reserved_extra_args = (talker_engine.EXTRA_ARG,)
    engine_args = staticmethod(engine_args)

    def __init__(self, folder: str | Path, stage: str = "talker"):
        import torch
        from transformers import AutoConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerResizeMLP,
        )

        self.folder = Path(folder)
        self.stage = stage
        self._codes_dir: str | None = None
        config = AutoConfig.from_pretrained(self.folder)
        talker = getattr(config, "talker_config", None)
        if talker is None or not getattr(config, "enable_audio_output", True):
            raise ValueError(f"{self.folder} is a Qwen3-Omni checkpoint without a talker")
        self.config, self.talker = config, talker
        self.codec_groups = talker.num_code_groups
        self.vocab_size = talker.text_config.vocab_size
        names = {mlp: [f"talker.{mlp}.{p}.{w}" for p in ("linear_fc1", "linear_fc2")
                       for w in ("weight", "bias")] for mlp in ("text_projection", "hidden_projection")}
        weights = _tensors(self.folder, [CODEC_EMBED, *sum(names.values(), [])])
        self.projection, self.hidden_projection = (
            self._mlp(Qwen3OmniMoeTalkerResizeMLP(talker), weights, names[mlp])
            for mlp in ("text_projection", "hidden_projection"))
        self._thinker_embed = None  # the whole table, loaded only to build prompts from ids
        with torch.no_grad():
            self._pad_bos = self.projection(torch.as_tensor(read_rows(
                self.folder, THINKER_EMBED, [config.tts_pad_token_id, config.tts_bos_token_id])))
        self.codec_embed = torch.nn.Embedding.from_pretrained(weights[CODEC_EMBED])
        self.stop_ids = [talker.codec_eos_token_id]
        top = self.vocab_size - SUPPRESSED_TOP_IDS
        self.allowed_ids = [i for i in range(self.vocab_size) if i < top or i in self.stop_ids]
        self.voices = {name.lower(): int(i) for name, i in (talker.speaker_id or {}).items()}
        self.media_ids = {talker.audio_token_id, talker.image_token_id, talker.video_token_id}
        self._rope = _RopeIndex(talker, config.thinker_config.audio_config)

    @staticmethod
    async def check(engine) -> list[str]:
        """Why the started engine cannot run this talker (its workers' feed install)."""
        return [r for r in await engine.collective_rpc(talker_engine.RPC) if r]

    @staticmethod
    def _mlp(module, weights: dict, names: list[str]):
        prefix = names[0].rsplit(".", 2)[0] + "."
        module.load_state_dict({n[len(prefix):]: weights[n] for n in names})
        return module.eval()

    def sampling(self, requested: dict[str, Any], max_model_len: int | None = None) -> dict[str, Any]:
        """The request's sampling fields over the checkpoint's defaults (SamplingParams kwargs)."""
        params = {**DEFAULT_SAMPLING, **requested}
        if max_model_len:
            params["max_tokens"] = min(int(params["max_tokens"]), max_model_len)
        params["stop_token_ids"] = list(self.stop_ids)
        params["allowed_token_ids"] = list(self.allowed_ids)
        return params

    def _embed(self, ids: list[int]) -> np.ndarray:
        """The thinker's input embeddings of `ids` (reads the whole table once)."""
        import torch

        if self._thinker_embed is None:
            self._thinker_embed = _tensors(self.folder, [THINKER_EMBED])[THINKER_EMBED]
        return self._thinker_embed[torch.tensor(ids, dtype=torch.long)].numpy()

    def prompt_embeds(self, prompt_ids: list[int], reply_ids: list[int], voice: str,
                      thinker_hidden: np.ndarray | None = None):
        """The talker's prefill rows, float32 [users + 9, hidden] (transformers' generate).

        `thinker_hidden`: the thinker's hidden states after layer `accept_hidden_layer` at
        the prompt's positions ([len(prompt_ids), thinker hidden]); read at media positions,
        needed only when a user turn has media.
        """
        turn = assistant_ids(prompt_ids, reply_ids, self.config)
        if len(turn) < 4:
            raise ValueError("the talker needs the assistant turn's first reply token")
        ids = list(prompt_ids[:assistant_start(prompt_ids, self.config)]) + turn[:4]
        embeds = self._embed(ids)
        return self.prompt_from_rows(prompt_ids, embeds, thinker_hidden, voice)

    def prompt_from_rows(self, prompt_ids: list[int], embeds: np.ndarray,
                         hidden: np.ndarray | None, voice: str):
        """The prefill rows from the thinker's rows 0 .. start+3 (start: the assistant turn's
        <|im_start|>, row start+3: reply token 0): its input embeddings, and its hidden
        states after `accept_hidden_layer` (read at media positions only)."""
        import torch

        cfg, talker = self.config, self.talker
        start = assistant_start(prompt_ids, cfg)
        users = user_positions(prompt_ids, cfg)
        media = [i for i in users if prompt_ids[i] in self.media_ids]
        if media and hidden is None:
            raise ValueError("a prompt with media needs the thinker's hidden states at "
                             f"layer {talker.accept_hidden_layer} (accept_hidden_layer)")
        if voice.lower() not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; known voices: {', '.join(sorted(self.voices))}")
        pad, bos = self._pad_bos
        codec_ids = [talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id,
                     self.voices[voice.lower()], talker.codec_pad_id, talker.codec_bos_id]
        with torch.no_grad():
            head = self.projection(torch.as_tensor(np.asarray(embeds[start:start + 4], np.float32)))
            text = torch.cat([head[:3], pad.expand(4, -1), bos[None], head[3:4]])
            codec = torch.cat([torch.zeros(3, text.shape[1]), self.codec_embed(torch.tensor(codec_ids))])
            user_rows = self.projection(torch.as_tensor(np.asarray(embeds, np.float32)[users]))
            if media:
                rows = torch.as_tensor(np.asarray(hidden, np.float32)[media])
                where = torch.tensor([users.index(i) for i in media])
                user_rows[where] = self.hidden_projection(rows)
        return torch.cat([user_rows, text + codec])

    def positions(self, prompt_ids: list[int], media: dict[str, Any]) -> tuple[np.ndarray, int] | None:
        """(the prompt's M-RoPE positions [3, users + 9], delta: decode position q has q + delta)
        for a prompt with media (`media`: image_grid_thw, video_grid_thw, audio_feature_lengths,
        use_audio_in_video, video_second_per_grid, as the processor made them); None for text."""
        if not any(media.get(k) is not None for k in ("image_grid_thw", "video_grid_thw",
                                                       "audio_feature_lengths")):
            return None
        users = [prompt_ids[i] for i in user_positions(prompt_ids, self.config)]
        return self._rope(users + [self.config.tts_pad_token_id] * 9, media)

    def build(self, prompt_ids: list[int], reply_ids: list[int], voice: str, codes_file: str,
              thinker_file: str | None = None,
              thinker_hidden: np.ndarray | None = None,
              media: dict[str, Any] | None = None) -> tuple[dict, dict]:
        """(vLLM EmbedsPrompt, SamplingParams.extra_args: the engine feed) from token ids.

        `reply_ids`: the whole reply, or with `thinker_file` (the thinker's handed-over
        capture file, still growing) its first 2 tokens or more: the decode steps then read
        their text from the file's embedding rows as the thinker writes them.
        `thinker_hidden`, `media`: a prompt with media's (`prompt_embeds`, `positions`).
        """
        embeds = self.prompt_embeds(prompt_ids, reply_ids, voice, thinker_hidden)
        prompt, extra = self._engine_prompt(embeds, prompt_ids, codes_file, thinker_file, media)
        if thinker_file is None:
            extra[talker_engine.EXTRA_ARG]["text_ids"] = trailing_text_ids(
                prompt_ids, reply_ids, self.config)
        return prompt, extra

    def _engine_prompt(self, embeds, prompt_ids: list[int], codes_file: str,
                       thinker_file: str | None, media: dict[str, Any] | None) -> tuple[dict, dict]:
        n = embeds.shape[0]
        prompt = {
            "prompt_embeds": embeds,
            # what vLLM's repetition penalty sees of the prompt: a code it never samples
            # (transformers' talker penalizes only the codes it generated)
            "prompt_token_ids": [self.talker.codec_pad_id] * n,
            "prompt_is_token_ids": [False] * n,
        }
        cfg = self.config
        feed: dict[str, Any] = {"prompt_len": n, "pad_id": cfg.tts_pad_token_id,
                                "codes_file": codes_file}
        if thinker_file is not None:
            feed.update(file=thinker_file, width=2 * self.talker.thinker_hidden_size,
                        first_row=assistant_start(prompt_ids, cfg) + 4, eos_id=cfg.tts_eos_token_id)
        if media and (rope := self.positions(prompt_ids, media)) is not None:
            feed["positions"], feed["delta"] = rope[0].tolist(), rope[1]
        return prompt, {talker_engine.EXTRA_ARG: feed}

    # --- the talker stage's side (talker/stage.py: TalkerSide) -----------------------

    def voice(self, name: str | None) -> str:
        name = (name or DEFAULT_VOICE).lower()
        if name not in self.voices:
            raise RequestError(TALKER.VOICE, f"unknown voice {name!r}; known voices: "
                                             f"{', '.join(sorted(self.voices))}")
        return name

    async def prompt(self, req: TalkerInput, timeout_s: float) -> tuple[dict, dict]:
        """(vLLM EmbedsPrompt, SamplingParams.extra_args) of a talker request on the thinker's
        handed-over capture file (rows [input embedding | hidden after accept_hidden_layer]):
        waits for reply token 0's row, and reads the decode steps' text from the file as
        the thinker writes it. The codes file it names is the caller's to remove
        (`FrameStream.close`)."""
        voice = self.voice(req.voice)
        if not talker_engine.valid_shm_file(req.source):
            raise RequestError(TALKER.THINKER_HIDDEN_STATES_FILE,
                               "must be a hidden-state file a thinker stage on this host handed "
                               f"over (hidden_states_in_shm), got {req.source!r}")
        ids = list(req.prompt_token_ids)
        try:
            start = assistant_start(ids, self.config)
        except ValueError as e:
            raise RequestError(TALKER.PROMPT_TOKEN_IDS, str(e)) from None
        width = 2 * self.talker.thinker_hidden_size
        rows = await _wait_rows(req.source, start + 4, width, timeout_s)
        embeds, hidden = hidden_states.split_rows(rows)
        media = {"image_grid_thw": req.image_grid_thw,
                 "audio_feature_lengths": req.audio_feature_lengths,
                 "video_grid_thw": req.video_grid_thw,
                 "video_second_per_grid": req.video_second_per_grid,
                 "use_audio_in_video": req.use_audio_in_video}
        codes_file = self._new_codes_file()
        embeds_ = self.prompt_from_rows(ids, embeds, hidden, voice)
        return self._engine_prompt(embeds_, ids, codes_file, req.source, media)

    def _new_codes_file(self) -> str:
        if self._codes_dir is None or not os.path.isdir(self._codes_dir):
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._codes_dir = tempfile.mkdtemp(prefix="omni_hs_talker_", dir=base)
        path = os.path.join(self._codes_dir, secrets.token_hex(12))
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return path

    def close(self) -> None:
        """The stage stops: remove the codes folder (its requests' files are gone with them)."""
        if self._codes_dir is not None:
            shutil.rmtree(self._codes_dir, ignore_errors=True)
            self._codes_dir = None

    def frame_stream(self, extra_args: dict) -> FrameStream:
        """The frames of the request whose engine feed is `extra_args[EXTRA_ARG]`."""
        return FrameStream(extra_args[talker_engine.EXTRA_ARG]["codes_file"], self.codec_groups)


DEFAULT_VOICE = "ethan"  # transformers' generate(speaker="Ethan")


class FrameStream:
    """One talker request's frames, [n, groups] int64, as they complete (talker stage).

    Code 0 of each frame comes with the engine's outputs; codes 1..groups-1 of frame f
    are in the codes file before code 0 of frame f + 1 comes out. The last code 0 never
    gets its residual codes (the talker's eos, or the one cut by max_tokens: transformers
    drops it too), so a frame is complete once the next code 0 is there.
    """

    def __init__(self, path: str, groups: int):
        self.path, self.groups = path, groups
        self.code0: list[int] = []
        self.sent = 0

    def push(self, new_ids: list[int]) -> np.ndarray:
        """The frames completed by these new code 0s."""
        self.code0 += [int(i) for i in new_ids]
        done = max(len(self.code0) - 1, 0)
        if done <= self.sent:
            return np.zeros((0, self.groups), np.int64)
        residual = talker_engine.read_codes(self.path, self.groups)
        if len(residual) < done:
            raise RuntimeError(f"the talker engine wrote residual codes of {len(residual)} "
                               f"frames, {done} have their next code 0")
        out = np.concatenate([np.asarray(self.code0[self.sent:done], np.int64)[:, None],
                              residual[self.sent:done].astype(np.int64)], axis=1)
        self.sent = done
        return out

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


async def _wait_rows(path: str, rows: int, width: int, timeout_s: float) -> np.ndarray:
    """Rows [0, rows) of the thinker's file once written (polled until the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        have = hidden_states.rows_in(path, width)
        if have is None:
            raise RequestError(TALKER.THINKER_HIDDEN_STATES_FILE,
                               f"{path} does not exist (the thinker request ended?)")
        if have >= rows and (data := hidden_states.read_rows(path, 0, rows, width)) is not None:
            return data
        final = hidden_states.final_rows(path)
        if final is not None and final < rows:
            raise RequestError(TALKER.THINKER_HIDDEN_STATES_FILE,
                               f"the thinker's reply ended after {final} rows; the talker "
                               f"needs {rows} (a reply of at least 2 tokens)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the thinker wrote {have} of the {rows} rows the "
                               f"talker's prompt needs within {timeout_s:g} s")
        await asyncio.sleep(0.002)
