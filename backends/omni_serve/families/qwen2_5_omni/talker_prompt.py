"""Qwen2.5-Omni's talker prompt and engine arguments (runs in the omni_talker stub process).

An omni_talker stage serves the checkpoint's own talker (families/qwen2_5_omni/talker_model.py)
from the whole Qwen2.5-Omni folder. One talker request names the thinker's hidden-state file
(`thinker_hidden_states_file`, written by the thinker stage with
`hidden_states_in_shm`, same host), the thinker's prompt as the engine saw it
(`prompt_token_ids`, placeholders expanded), the media grids for the 3D
positions (`image_grid_thw`, `audio_feature_lengths`) and the `voice`.

`TalkerPrompter.prompt` waits until the thinker has fed its first reply token
(row `prompt_len`), then builds the prefill exactly as transformers'
`Qwen2_5OmniForConditionalGeneration.generate` does:

    rows 0..L-1   thinker input embedding (zero at media positions) + hidden state
    row  L        the voice's `bos_token` embedding (thinker vocabulary) + codec pad
    row  L+1      reply token 0's embedding + hidden state + codec bos

with the talker's M-RoPE positions from the model's own `get_rope_index`, and
the decode steps' inputs described in families/qwen2_5_omni/talker_engine.py. Sampling defaults
are the checkpoint's (`generate`'s talker_* defaults): stops on codec pad or
end, never samples codec bos.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from omni_serve.contract import TALKER
from omni_serve.errors import RequestError
from omni_serve.families.checkpoint_tensors import read_rows
from omni_serve.families.qwen2_5_omni import talker_engine
from omni_serve.families.talker_generation import with_talker_stops
from omni_serve.llm import hidden_states
from omni_serve.talker.request import TalkerInput

ARCHITECTURE = "OmniTalkerForConditionalGeneration"  # registered by llm/vllm_models.py
SPEAKERS_FILE = "spk_dict.pt"
# transformers' Qwen2_5OmniForConditionalGeneration.generate talker defaults
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.9, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05, "max_tokens": 4096,
}


def engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments of a talker stage (the checkpoint folder as `model`).

    vLLM sizes logits, sampling masks and the prompt embeddings from the text
    config, which for Qwen2.5-Omni is the thinker's: its hidden size is the
    talker's `embedding_size` (the width of what the talker reads), and its
    vocabulary is set to the talker's codec vocabulary here. Its generation
    config holds the talker's own stop codes (families/talker_generation.py).
    """
    overrides = dict(args.get("hf_overrides") or {})
    overrides["architectures"] = [ARCHITECTURE]
    config = json.loads((Path(args["model"]) / "config.json").read_text())
    talker = config.get("talker_config", {})
    vocab = talker.get("vocab_size")
    if vocab:
        overrides["thinker_config"] = {"text_config": {"vocab_size": int(vocab)}}
    out = {
        **args,
        "hf_overrides": overrides,
        "enable_prompt_embeds": True,
        "skip_tokenizer_init": True,
        # a cached block would skip the per-step reply vectors of another request
        "enable_prefix_caching": False,
        # the scheduler holds back requests whose next vector is not there yet
        "async_scheduling": False,
        "scheduler_cls": talker_engine.SCHEDULER,
        "worker_extension_cls": talker_engine.EXTENSION,
    }
    stops = [talker[k] for k in ("tts_codec_pad_token_id", "tts_codec_end_token_id")
             if k in talker]
    return with_talker_stops(args, out, stops if len(stops) == 2 else [])


class _RopeIndex:
    """transformers' own Qwen2.5-Omni `get_rope_index`, bound to the talker config."""

    def __init__(self, config):
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

        base = m.Qwen2_5OmniPreTrainedModelForConditionalGeneration
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self._index = base.get_rope_index.__get__(self)
        self.get_llm_pos_ids_for_vision = base.get_llm_pos_ids_for_vision.__get__(self)
        self.get_chunked_index = base.get_chunked_index.__get__(self)  # audio in video

    def __call__(self, ids: list[int], grid: np.ndarray | None, audio: np.ndarray | None,
                 video: np.ndarray | None = None, seconds: np.ndarray | None = None,
                 audio_in_video: bool = False):
        import torch

        def tensor(a: np.ndarray | None):
            return None if a is None else torch.from_numpy(a)

        input_ids = torch.tensor([ids])
        pos, delta = self._index(input_ids, tensor(grid), tensor(video), torch.ones_like(input_ids),
                                 audio_in_video, tensor(audio), tensor(seconds))
        return pos[:, 0].numpy().astype(np.int64), int(delta.reshape(-1)[0])


class TalkerPrompter:
    """The talker stage's Qwen2.5-Omni side (talker/stage.py's TalkerSide): builds talker
    prompts from the thinker's rows; one per talker stage."""

    codec_groups = 1  # one codebook: one code a step
    reserved_extra_args = (talker_engine.EXTRA_ARG,)  # what `prompt` puts in extra_args
    engine_args = staticmethod(engine_args)

    @staticmethod
    async def check(engine) -> list[str]:
        """Why the started engine cannot run this talker (its workers' feed install)."""
        return [r for r in await engine.collective_rpc(talker_engine.RPC) if r]

    def __init__(self, folder: str | Path, stage: str = "talker"):
        import torch
        from transformers import AutoConfig

        self.folder = Path(folder)
        self.stage = stage
        config = AutoConfig.from_pretrained(self.folder)
        talker = getattr(config, "talker_config", None)
        if talker is None:
            raise ValueError(f"{self.folder} is not a Qwen2.5-Omni checkpoint with a talker "
                             "(config.json has no talker_config)")
        self.config = talker
        path = self.folder / SPEAKERS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the talker needs the voices' tokens")
        speakers = torch.load(path, map_location="cpu", weights_only=True)  # spk_dict: name -> ...
        self.voice_tokens = {name: int(v["bos_token"]) for name, v in speakers.items()}
        self.default_voice = ("Chelsie" if "Chelsie" in self.voice_tokens
                              else next(iter(self.voice_tokens)))
        names = list(self.voice_tokens)
        self._bos = dict(zip(names, read_rows(self.folder, "thinker.model.embed_tokens.weight",
                                          [self.voice_tokens[n] for n in names]), strict=True))
        pad, bos = talker.tts_codec_pad_token_id, talker.tts_codec_start_token_id
        self._codec_pad, self._codec_bos = read_rows(self.folder, "talker.model.embed_tokens.weight",
                                                 [pad, bos])
        self.media_ids = {talker.image_token_index, talker.audio_token_index,
                          talker.video_token_index}
        self.stop_ids = [pad, talker.tts_codec_end_token_id]
        self.allowed_ids = [i for i in range(talker.vocab_size) if i != bos]
        self.width = 2 * talker.embedding_size
        self.vocab_size = talker.vocab_size
        self._rope = _RopeIndex(talker)

    def sampling(self, requested: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
        """The request's sampling fields over the checkpoint's defaults."""
        params = {**DEFAULT_SAMPLING, **requested}
        if max_model_len:
            params["max_tokens"] = min(int(params["max_tokens"]), max_model_len)
        params["stop_token_ids"] = list(self.stop_ids)
        params["allowed_token_ids"] = list(self.allowed_ids)
        return params

    def frame_stream(self, extra_args: dict):
        """One code a frame: the ids as they come, the stop code left out."""
        from omni_serve.talker.stage import StopCutStream

        return StopCutStream(self.codec_groups, self.stop_ids)

    def close(self) -> None:
        """Nothing kept between requests."""

    def voice(self, name: str | None) -> str:
        name = name or self.default_voice
        if name not in self.voice_tokens:
            raise RequestError(TALKER.VOICE, f"unknown voice {name!r}; known voices: "
                                          f"{', '.join(sorted(self.voice_tokens))}")
        return name

    async def prompt(self, req: TalkerInput, timeout_s: float) -> tuple[dict, dict]:
        """(vLLM EmbedsPrompt, what goes into SamplingParams.extra_args: the engine feed)."""
        import torch

        voice = self.voice(req.voice)
        if not talker_engine.valid_source(req.source):
            raise RequestError(TALKER.THINKER_HIDDEN_STATES_FILE,
                               "must be a hidden-state file a thinker stage on this host handed "
                               f"over (hidden_states_in_shm), got {req.source!r}")
        n = len(req.prompt_token_ids)
        rows = await self._wait_rows(req.source, n + 1, timeout_s)
        embed, hidden = hidden_states.split_rows(rows)
        ids = np.asarray(req.prompt_token_ids)
        embed[:n][np.isin(ids, list(self.media_ids))] = 0.0  # transformers zeroes media rows
        summed = embed + hidden
        prefill = np.concatenate([summed[:n], self._bos[voice][None], summed[n:n + 1]])
        prefill[-2] += self._codec_pad
        prefill[-1] += self._codec_bos
        positions, delta = self._rope([*req.prompt_token_ids, self.voice_tokens[voice], 0],
                                      req.image_grid_thw, req.audio_feature_lengths,
                                      req.video_grid_thw, req.video_second_per_grid,
                                      req.use_audio_in_video)
        cfg = self.config
        prompt = {
            "prompt_embeds": torch.from_numpy(prefill),
            # what transformers' repetition penalty sees as the talker's prompt
            "prompt_token_ids": [cfg.tts_codec_mask_token_id] * n
            + [cfg.tts_codec_pad_token_id, cfg.tts_codec_start_token_id],
            "prompt_is_token_ids": [False] * (n + 2),
        }
        feed = {"file": req.source, "width": self.width, "prompt_len": n + 2,
                "positions": positions.tolist(), "delta": delta}
        return prompt, {talker_engine.EXTRA_ARG: feed}

    async def _wait_rows(self, path: str, rows: int, timeout_s: float) -> np.ndarray:
        """Rows [0, rows) of the thinker's file once written (polled until the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            have = hidden_states.rows_in(path, self.width)
            if have is None:
                raise RequestError(TALKER.THINKER_HIDDEN_STATES_FILE,
                                   f"{path} does not exist (the thinker request ended?)")
            if have >= rows and (data := hidden_states.read_rows(path, 0, rows, self.width)) is not None:
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
