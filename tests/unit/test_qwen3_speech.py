"""Qwen3-Omni's speech wiring: the thinker rows' layer, the orchestrator's feed, the talker's frames.

No engine runs: the capture's worker side is driven with the fake model runner of
test_hidden_states (a model that keeps another layer's output, as families/qwen3_omni_moe/
thinker.py does), the feed and the frame streams are plain objects, and the stage's `serve`
runs on a scripted host. The engines themselves are compared with transformers in
tests/integration/test_qwen3_omni.py.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_serve import families
from omni_serve.contract import AUDIO, LLM, TALKER
from omni_serve.families import DecoderChunk, ThinkerReply
from omni_serve.llm.hidden_states import CaptureFile
from omni_serve.talker.request import TalkerRequest
from omni_serve.talker.stage import StopCutStream, TalkerStage
from tests.unit.test_hidden_states import (
    FakeRunner,
    H,
    Worker,
    _request,
    _rows,
    _step,
    capture_dir,  # noqa: F401  (fixture)
)

QWEN3 = families.get("qwen3_omni_moe")


# --- the thinker's rows: the layer its vLLM class keeps ------------------------------------

class LayerKeepingRunner(FakeRunner):
    """A model that keeps an earlier layer's output (`omni_capture_hidden`) beside its last."""

    def __init__(self):
        super().__init__(with_embeds=True)
        self.model.omni_capture_layer = 2
        self.model.omni_capture_hidden = None

    def _model_forward(self, input_ids=None, positions=None, inputs_embeds=None, **_):
        self.model.omni_capture_hidden = inputs_embeds * 3 - 2  # "layer 2's output"
        return super()._model_forward(input_ids, positions, inputs_embeds)


def test_the_rows_hold_the_layer_the_thinker_keeps_not_its_last(capture_dir):  # noqa: F811
    runner = LayerKeepingRunner()
    assert Worker(runner).omni_capture_hidden_states() == ""
    a = CaptureFile(str(capture_dir), H)
    runner.requests = {"a": _request(a.token)}
    _step(runner, [("a", [1, 2, 3], 0, True)])
    _step(runner, [("a", [4], 3, False)])
    embeds = FakeRunner.embed(torch.tensor([1, 2, 3, 4])).numpy()
    got = _rows(a, 4)
    np.testing.assert_array_equal(got[:, :H], embeds)
    np.testing.assert_array_equal(got[:, H:], embeds * 3 - 2)


@pytest.mark.parametrize("config, layer", [
    ({"talker_config": {"accept_hidden_layer": 24}}, 24),
    ({"talker_config": {"accept_hidden_layer": 2}, "enable_audio_output": True}, 2),
    ({"talker_config": {"accept_hidden_layer": 24}, "enable_audio_output": False}, None),
    ({}, None),  # a thinker alone
])
def test_the_kept_layer_is_the_talkers_accept_hidden_layer(config, layer):
    from omni_serve.families.qwen3_omni_moe.thinker import capture_layer

    def ns(value):
        return SimpleNamespace(**{k: ns(v) if isinstance(v, dict) else v for k, v in value.items()})

    assert capture_layer(ns(config)) == layer


# --- the orchestrator's feed --------------------------------------------------------------

def test_the_talker_starts_on_the_handed_over_rows_after_two_reply_tokens():
    feed = QWEN3.speech
    assert feed.codec_groups == 16
    assert feed.thinker_inputs[LLM.HIDDEN_STATES_IN_SHM].all()
    reply = ThinkerReply(file="/dev/shm/x", prompt_ids=[1, 2, 3], reply_ids=[7], reply_tokens=1)
    assert not feed.talker_ready(reply)
    reply.reply_ids.append(8)
    reply.reply_tokens = 2
    assert feed.talker_ready(reply)
    assert not feed.talker_ready(ThinkerReply(prompt_ids=[1], reply_tokens=5))  # no file


def test_a_talker_request_names_the_file_the_prompt_the_speaker_and_sampling():
    reply = ThinkerReply(file="/dev/shm/omni_hs_1/abc", prompt_ids=[5, 6, 7], reply_ids=[1, 2],
                         reply_tokens=2)
    grid = np.array([[1, 4, 4]], np.int64)
    inputs = QWEN3.speech.talker_inputs(reply, {TALKER.IMAGE_GRID_THW: grid}, "ethan",
                                        {"temperature": 0, "seed": 3})
    assert inputs[TALKER.THINKER_HIDDEN_STATES_FILE].tolist() == [b"/dev/shm/omni_hs_1/abc"]
    assert inputs[TALKER.PROMPT_TOKEN_IDS].tolist() == [5, 6, 7]
    assert inputs[TALKER.VOICE].tolist() == [b"ethan"]
    assert json.loads(inputs[TALKER.SAMPLING_PARAMETERS][0]) == {"temperature": 0, "seed": 3}
    assert inputs[TALKER.IMAGE_GRID_THW] is grid
    assert TALKER.VOICE not in QWEN3.speech.talker_inputs(reply, {}, None, {})


def test_a_code2wav_request_carries_the_chunks_frames_and_context_no_voice_no_seed():
    frames = np.arange(5 * 16).reshape(5, 16)
    inputs = QWEN3.speech.decoder_inputs(DecoderChunk(frames, 3, 0, 40, 45), seed=9, voice="ethan")
    assert inputs[AUDIO.CODEC_IDS].shape == (1, 5, 16)
    np.testing.assert_array_equal(inputs[AUDIO.CODEC_IDS][0], frames)
    assert (inputs[AUDIO.CONTEXT_TOKENS].item(), inputs[AUDIO.LOOKAHEAD_TOKENS].item(),
            inputs[AUDIO.CODE_OFFSET].item()) == (3, 0, 40)
    assert AUDIO.VOICE not in inputs and AUDIO.SEED not in inputs


# --- the talker stage's frames ------------------------------------------------------------

def test_a_one_code_talker_stream_leaves_its_stop_code_out():
    stream = StopCutStream(1, [99, 98])
    assert stream.push([4, 5]).tolist() == [[4], [5]]
    assert stream.push([6, 98]).tolist() == [[6]]
    assert stream.push([]).shape == (0, 1)


class ScriptedHost:
    """The EngineHost parts `serve` uses: the engine's outputs scripted."""

    max_model_len = 100

    def __init__(self, outputs, fail=False):
        self.outputs, self.fail = outputs, fail

    async def render_prompt(self, prompt):
        return prompt

    def aborted(self, request_id):
        return False

    async def generate(self, engine_input, params, request_id, arrival, stream):
        for ids, finish in self.outputs:
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=finish)],
                                  finished=finish is not None), None, None
        if self.fail:
            raise RuntimeError("engine died")


class RecordingSide:
    codec_groups = 2
    vocab_size = 10
    stop_ids = [9]
    reserved_extra_args = ()

    def __init__(self):
        self.streams = []

    def sampling(self, requested, max_model_len):
        return {"temperature": 0, "max_tokens": 5}

    async def prompt(self, req, timeout_s):
        return {"prompt_token_ids": [1]}, {"feed": len(self.streams)}

    def frame_stream(self, extra_args):
        side = self

        class Pairs:  # two ids a frame, held back until whole
            def __init__(self):
                self.ids, self.closed, self.extra = [], False, extra_args
                side.streams.append(self)

            def push(self, new_ids):
                self.ids += new_ids
                done, self.ids = self.ids[:len(self.ids) // 2 * 2], self.ids[len(self.ids) // 2 * 2:]
                return np.asarray(done, np.int64).reshape(-1, 2)

            def close(self):
                self.closed = True

        return Pairs()


def _serve(host, side) -> list:
    stage = TalkerStage.__new__(TalkerStage)
    stage.host, stage.side = host, side
    sent = []
    sink = SimpleNamespace(send=sent.append)
    req = TalkerRequest("r1", feed=None)
    asyncio.run(stage.serve(req, sink, 0.0))
    return sent


def test_the_stage_sends_the_frames_its_sides_stream_completes_and_closes_it():
    side = RecordingSide()
    sent = _serve(ScriptedHost([([1, 2, 3], None), ([4, 5], None), ([6], "length")]), side)
    assert [o.codes.tolist() for o in sent] == [[[1, 2]], [[3, 4]], [[5, 6]]]
    assert [s.closed for s in side.streams] == [True] and side.streams[0].extra == {"feed": 0}


def test_the_stream_closes_when_the_engine_fails():
    side = RecordingSide()
    with pytest.raises(RuntimeError, match="engine died"):
        _serve(ScriptedHost([([1, 2], None)], fail=True), side)
    assert side.streams[0].closed


# --- omni-gen-repo: what the orchestrator's engine.json gets from the folder ----------------

def test_the_voices_are_the_talkers_speakers_in_config_json(tmp_path):
    from omni_tools import checkpoint

    speakers = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_omni_moe", "talker_config": {"speaker_id": speakers}}))
    assert checkpoint.voices(tmp_path) == list(speakers)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    assert checkpoint.voices(tmp_path) is None  # a thinker alone


def test_a_speaker_in_any_case_and_an_openai_voice_reach_config_jsons_speakers():
    from omni_serve.orchestrator.config import OrchestratorConfig

    cfg = OrchestratorConfig.model_validate({
        "family": "qwen3_omni_moe", "voices": ["aiden", "chelsie", "ethan"],
        "stages": {"thinker": "llm", "talker": "talker", "audio_decoder": "dec"}})
    assert [cfg.voice(v) for v in ("ethan", "Ethan", "CHELSIE", "onyx", "nova")] == [
        "ethan", "ethan", "chelsie", "ethan", "chelsie"]
    assert cfg.voice("Nobody") is None
