"""A second model family, made up here, runs through the orchestrator's speech path unchanged.

"fourway" is registered from the test tree only (omni_serve.families.register): its talker
reads the thinker's reply token ids (not a hidden-state file), emits frames of 4 codes, and
its decoder takes [frames, 4] with its own input names. Fake stages play the thinker, the
talker and the decoder; nothing under backends/omni_serve knows this family.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from omni_serve import families
from omni_serve.contract import AUDIO, LLM, OMNI, TALKER
from omni_serve.families import DecoderChunk, Family, ThinkerReply
from omni_serve.orchestrator.config import OrchestratorConfig
from omni_serve.orchestrator.pipeline import AudioChunk, CodecIds, OmniPipeline
from tests.unit.chat import tiny_chat_prompt
from tests.unit.test_orchestrator import ScriptedStages, config, run, tensors

GROUPS = 4
FRAMES = 11


class FourWaySpeech:
    codec_groups = GROUPS
    thinker_inputs = {LLM.RETURN_TOKEN_IDS: np.array([True])}
    thinker_outputs = (LLM.TOKEN_IDS,)

    def talker_ready(self, reply: ThinkerReply) -> bool:
        return len(reply.reply_ids) >= 3

    def talker_inputs(self, reply, media, voice, sampling):
        return {"reply_token_ids": np.array(reply.reply_ids, np.int64),
                TALKER.SAMPLING_PARAMETERS: np.array([json.dumps(sampling).encode()], np.object_)}

    def decoder_inputs(self, chunk: DecoderChunk, seed, voice):
        return {"frames": chunk.frames, "left": np.array([chunk.context]),
                "right": np.array([chunk.lookahead]), "at": np.array([chunk.offset])}


FOURWAY = Family(name="fourway", title="Four-Way Omni", model_types=("fourway_omni",), parts={},
                 system_prompt="You speak in four voices at once.", speech=FourWaySpeech(),
                 speech_chunks={"first_chunk_codes": 7, "chunk_codes": 9})


def frame_at(position: int) -> list[int]:
    return [100 * position + g for g in range(GROUPS)]


class FourWayStages(ScriptedStages):
    """The thinker returns token ids when asked; the talker and decoder speak in frames."""

    def __init__(self):
        super().__init__(reply_tokens=8)
        self.frames_decoded: list[tuple[list[list[int]], int, int, int]] = []

    async def _think(self, inputs):
        n = 0
        async for out in super()._think(inputs):
            if LLM.RETURN_TOKEN_IDS in inputs:
                out[LLM.TOKEN_IDS] = np.array([1000 + n], np.int64)
            n += 1
            yield out

    async def _talk(self, inputs):
        assert TALKER.THINKER_HIDDEN_STATES_FILE not in inputs
        self.log.append("talker")
        position = 0
        while position < FRAMES:
            await asyncio.sleep(0.002)
            batch = [frame_at(p) for p in range(position, min(position + 2, FRAMES))]
            position += len(batch)
            yield {TALKER.CODEC_IDS: np.array(batch, np.int64)}
        yield {TALKER.CODEC_IDS: np.zeros((0, GROUPS), np.int64)}

    async def infer(self, model, inputs, outputs):
        if model != "dec":
            return await super().infer(model, inputs, outputs)
        self.calls.append((model, inputs))
        frames = np.asarray(inputs["frames"])
        left, right, at = (int(inputs[k][0]) for k in ("left", "right", "at"))
        self.frames_decoded.append((frames.tolist(), left, right, at))
        voiced = frames[left:len(frames) - right]
        pcm = np.array([row[0] for row in voiced], np.float32)  # one sample a frame
        return {AUDIO.AUDIO_CHUNK: pcm[None], AUDIO.SAMPLE_RATE: np.array([[100]], np.int32)}


@pytest.fixture()
def fourway():
    families.register(FOURWAY)
    try:
        yield FOURWAY
    finally:
        families.unregister(FOURWAY.name)


def test_the_checkpoints_model_type_picks_the_family_and_unknown_ones_name_the_supported(fourway):
    assert families.for_config({"model_type": "fourway_omni"}) is fourway
    assert families.for_config({"model_type": "qwen2_5_omni"}).name == "qwen2_5_omni"
    with pytest.raises(ValueError, match=r"'llama' is not a model family.*fourway \(Four-Way"):
        families.for_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="already served by family 'fourway'"):
        families.register(Family(name="other", title="x", model_types=("fourway_omni",),
                                 parts={}))


def test_the_orchestrator_takes_the_familys_defaults_and_refuses_an_unknown_family(fourway):
    cfg = config(family="fourway")
    assert cfg.system_prompt == fourway.system_prompt and cfg.voice_map == {}
    assert config().system_prompt.startswith("You are Qwen")  # the default family's
    with pytest.raises(ValueError, match="unknown model family 'nope'; supported: .*qwen2_5_omni"):
        OrchestratorConfig.model_validate({"stages": {"thinker": "llm"}, "family": "nope"})


def test_the_chunk_sizes_default_to_the_familys_and_a_setting_wins(fourway):
    bare = {"stages": {"thinker": "llm"}}
    cfg = OrchestratorConfig.model_validate({**bare, "family": "fourway"})
    assert (cfg.first_chunk_codes, cfg.chunk_codes) == (7, 9)
    cfg = OrchestratorConfig.model_validate({**bare, "family": "fourway", "first_chunk_codes": 2})
    assert (cfg.first_chunk_codes, cfg.chunk_codes) == (2, 9)
    for name, family in (("qwen2_5_omni", families.get("qwen2_5_omni")),
                         ("qwen3_omni_moe", families.get("qwen3_omni_moe"))):
        cfg = OrchestratorConfig.model_validate({**bare, "family": name})
        fields = OrchestratorConfig.model_fields
        for key in ("first_chunk_codes", "min_first_chunk_codes", "chunk_codes",
                    "min_chunk_codes"):
            assert getattr(cfg, key) == family.speech_chunks.get(key, fields[key].default), key
    assert OrchestratorConfig.model_validate(
        {**bare, "family": "qwen3_omni_moe"}).min_first_chunk_codes == 4


@pytest.mark.parametrize("stream_audio", [True, False])
def test_the_speech_path_runs_a_made_up_family_of_four_code_groups(fourway, stream_audio):
    cfg = config(family="fourway")
    stages = FourWayStages()
    request = tensors(**{OMNI.MODALITIES: ["text", "audio"]})
    request[OMNI.RETURN_CODEC_IDS] = np.array([True])
    request[OMNI.STREAM_AUDIO] = np.array([stream_audio])
    events = run(OmniPipeline(cfg, stages, tiny_chat_prompt()), request, cfg)

    (thinker,) = stages.thinker_requests()
    assert thinker[LLM.RETURN_TOKEN_IDS].all() and LLM.RETURN_HIDDEN_STATES not in thinker
    (talker,) = stages.talker_requests()
    assert talker["reply_token_ids"].tolist()[:3] == [1000, 1001, 1002]  # it started on 3
    # the decoder got [frames, 4]; every frame voiced once, in order
    assert all(np.asarray(f).shape[1:] == (GROUPS,) for f, *_ in stages.frames_decoded)
    voiced = np.concatenate([e.pcm for e in events if isinstance(e, AudioChunk)])
    assert voiced.tolist() == [frame_at(p)[0] for p in range(FRAMES)]
    if stream_audio:
        assert len(stages.frames_decoded) > 1 and any(left for _, left, _, _ in stages.frames_decoded)
    else:
        assert [(left, right, at) for _, left, right, at in stages.frames_decoded] == [(0, 0, 0)]
    frames = [f for e in events if isinstance(e, CodecIds) for f in e.frames]
    assert frames == [frame_at(p) for p in range(FRAMES)]  # [frames][4], as the talker sent
