"""The speech path (orchestrator/speech.py) with scripted stages: the one talker request, the
decoder chunks, the order audio goes out in, codec ids, the hidden-state file's lifetime, task
"speech" (read text aloud) and the usage counts of the final metrics."""
from __future__ import annotations

import asyncio
import json
import os
import re

import numpy as np
import pytest

from omni_serve.contract import LLM, OMNI, TALKER
from omni_serve.errors import RequestError, StageFailedError
from omni_serve.families.qwen2_5_omni import FAMILY
from omni_serve.orchestrator.pipeline import (
    AudioChunk,
    CodecIds,
    Final,
    OmniPipeline,
    TextDelta,
)
from omni_serve.orchestrator.request import parse_request
from omni_serve.orchestrator.speech import ThinkerRows
from tests.unit.chat import tiny_chat_prompt
from tests.unit.test_orchestrator import (
    SAMPLES_PER_CODE,
    ScriptedStages,
    code_at,
    config,
    mark,
    tensors,
)

THINKER_INPUTS = FAMILY.speech.thinker_inputs

TALKER_CODES = 23
# config(): first chunk 3 codes, then 5; left context 2 aligned to 2, right context 2.
# (offset, context, lookahead, end) of each decoder call for a stream of 23 codes
CHUNKS = [(0, 0, 2, 3), (0, 3, 2, 8), (6, 2, 2, 13), (10, 3, 2, 18), (16, 2, 0, 23)]


def run_events(pipeline: OmniPipeline, cfg, **extra) -> list:
    events: list = []
    req = parse_request("r1", tensors(**extra), cfg)
    asyncio.run(pipeline.run(req, events.append))
    return events


def speak(stages: ScriptedStages | None = None, cfg=None, **extra) -> tuple[list, ScriptedStages]:
    """Run one request with audio out; (its events, the stages)."""
    cfg = cfg or config()
    stages = stages or ScriptedStages()
    extra.setdefault(OMNI.MODALITIES, ["text", "audio"])
    return run_events(OmniPipeline(cfg, stages, tiny_chat_prompt()), cfg, **extra), stages


def audio_of(events: list) -> list[AudioChunk]:
    return [e for e in events if isinstance(e, AudioChunk)]


def voiced_marks(events: list) -> list[int]:
    pcm = np.concatenate([c.pcm for c in audio_of(events)])
    assert pcm.size % SAMPLES_PER_CODE == 0
    return pcm[::SAMPLES_PER_CODE].astype(np.int64).tolist()


def every_code_in_order(n: int = TALKER_CODES) -> list[int]:
    return [mark(p, code_at(p)) for p in range(n)]


# --- the talker request ------------------------------------------------------------------

def test_the_thinker_keeps_its_rows_for_the_talker_only_when_audio_is_asked_for():
    _, stages = speak()
    (thinker,) = stages.thinker_requests()
    for name, value in THINKER_INPUTS.items():
        assert thinker[name].tolist() == value.tolist() == [True], name


def test_one_talker_request_names_the_thinkers_file_prompt_media_voice_and_sampling():
    talker_sampling = {"temperature": 0.3, "max_tokens": 50}
    _, stages = speak(image=b"img-bytes", audio=b"wav", voice=b"Ethan", seed=5,
                      **{OMNI.TALKER_SAMPLING_PARAMETERS: json.dumps(talker_sampling).encode()})
    (talker,) = stages.talker_requests()
    (thinker,) = stages.thinker_requests()
    assert set(talker) == {TALKER.THINKER_HIDDEN_STATES_FILE, TALKER.PROMPT_TOKEN_IDS,
                           TALKER.SAMPLING_PARAMETERS, TALKER.VOICE,
                           TALKER.IMAGE_GRID_THW, TALKER.AUDIO_FEATURE_LENGTHS}
    (path,) = stages.thinker_files
    assert talker[TALKER.THINKER_HIDDEN_STATES_FILE].tolist() == [path.encode()]
    # the prompt as the thinker engine saw it (its input_token_ids), not re-tokenized
    assert talker[TALKER.PROMPT_TOKEN_IDS].dtype == np.int64
    assert talker[TALKER.PROMPT_TOKEN_IDS].tolist() == stages.thinker_prompt_ids[0]
    assert talker[TALKER.IMAGE_GRID_THW].tolist() == thinker[LLM.IMAGE_GRID_THW].tolist()
    assert (talker[TALKER.AUDIO_FEATURE_LENGTHS].tolist()
            == thinker[LLM.AUDIO_FEATURE_LENGTHS].tolist())
    assert talker[TALKER.VOICE].tolist() == [b"Ethan"]
    # the config's defaults, the request's fields over them, and the request's seed
    sampling = json.loads(talker[TALKER.SAMPLING_PARAMETERS][0])
    assert sampling == {"temperature": 0.3, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05,
                        "max_tokens": 50, "seed": 5}
    assert stages.files_seen_by_talker == [True]


def test_without_media_or_voice_the_talker_gets_neither():
    _, stages = speak(seed=9)
    (talker,) = stages.talker_requests()
    assert not {TALKER.VOICE, TALKER.IMAGE_GRID_THW, TALKER.AUDIO_FEATURE_LENGTHS} & set(talker)
    sampling = json.loads(talker[TALKER.SAMPLING_PARAMETERS][0])
    assert sampling == {**config().talker_sampling, "seed": 9}


def test_the_talker_starts_on_the_second_reply_token_while_the_thinker_writes():
    _, stages = speak(ScriptedStages(reply_tokens=20, token_delay=0.02))
    started = stages.log.index("talker")
    assert stages.log[:started].count("text") == 2
    assert "audio" in stages.log[:stages.thinker_done_at]


def test_a_thinker_that_sends_several_tokens_a_response_still_gets_one_talker_request():
    class Merging(ScriptedStages):
        async def _think(self, inputs):
            outs = [out async for out in super()._think(inputs)]
            yield {**outs[0], **outs[1], **outs[2], LLM.INPUT_TOKEN_IDS: outs[0][LLM.INPUT_TOKEN_IDS]}
            for out in outs[3:]:
                yield out

    events, stages = speak(Merging(reply_tokens=6))
    assert len(stages.talker_requests()) == 1
    assert voiced_marks(events) == every_code_in_order()


# --- the decoder chunks --------------------------------------------------------------------

def test_the_decoder_gets_each_chunk_with_its_context_offset_and_the_one_seed():
    events, stages = speak(seed=5)
    assert [(offset, context, lookahead) for _, context, lookahead, offset, _ in stages.decoded] \
        == [(offset, context, lookahead) for offset, context, lookahead, _ in CHUNKS]
    for (codes, *_), (offset, _, lookahead, end) in zip(stages.decoded, CHUNKS, strict=True):
        assert codes == [code_at(p) for p in range(offset, end + lookahead)]
    assert {seed for *_, seed in stages.decoded} == {5}  # one utterance, one noise stream
    # every code voiced once, in order
    assert voiced_marks(events) == every_code_in_order()
    metrics = events[-1].metrics
    assert metrics["audio_seconds"] == pytest.approx(TALKER_CODES * SAMPLES_PER_CODE / 100)
    assert set(metrics["stage_seconds"]) == {"thinker", "talker", "audio_decoder"}


def test_audio_goes_out_in_order_when_later_chunks_finish_first():
    stages = ScriptedStages(first_decode_delay=0.3, code_delay=0.002)
    events, stages = speak(stages)
    begins = [offset + context for offset, context, *_ in CHUNKS]
    assert stages.decode_finished[0] != 0  # the first chunk finished after later ones
    assert sorted(stages.decode_finished) == begins
    assert voiced_marks(events) == every_code_in_order()


def test_without_a_seed_every_chunk_still_shares_one():
    _, stages = speak()
    seeds = {seed for *_, seed in stages.decoded}
    assert len(seeds) == 1
    assert json.loads(stages.talker_requests()[0][TALKER.SAMPLING_PARAMETERS][0])["seed"] in seeds


def test_stream_audio_false_decodes_all_codes_in_one_call_without_context():
    events, stages = speak(stream_audio=False)
    (call,) = stages.decoded
    codes, context, lookahead, offset, _ = call
    assert codes == [code_at(p) for p in range(TALKER_CODES)]
    assert (context, lookahead, offset) == (0, 0, 0)
    (chunk,) = audio_of(events)
    assert voiced_marks(events) == every_code_in_order()
    assert chunk.pcm.size == TALKER_CODES * SAMPLES_PER_CODE


def test_a_reply_done_before_its_first_chunk_could_go_is_decoded_in_one_call():
    # first chunk 3 codes + 2 of right context: 4 codes never allow it while streaming
    events, stages = speak(ScriptedStages(talker_codes=4))
    (call,) = stages.decoded
    codes, context, lookahead, offset, _ = call
    assert codes == [code_at(p) for p in range(4)] and (context, lookahead, offset) == (0, 0, 0)
    assert voiced_marks(events) == every_code_in_order(4)


def test_the_decoder_starts_while_the_talker_still_talks():
    _, stages = speak(ScriptedStages(code_delay=0.01))
    assert stages.log.index("audio") < stages.log.index("talker done")


# --- codec ids ------------------------------------------------------------------------------

def test_codec_ids_go_out_as_they_arrive_only_when_asked_for():
    events, stages = speak(return_codec_ids=True)
    codec = [e.frames for e in events if isinstance(e, CodecIds)]
    # one event per talker response, [frames][1 group]
    assert codec == [[[c] for c in g] for g in stages.talker_groups if g]
    assert sum(codec, []) == [[code_at(p)] for p in range(TALKER_CODES)]
    events, _ = speak()
    assert not any(isinstance(e, CodecIds) for e in events)


# --- short replies, the file, failures ------------------------------------------------------

def test_a_one_token_reply_has_no_talker_call_and_no_audio():
    events, stages = speak(ScriptedStages(reply_tokens=1))
    assert [m for m, _ in stages.calls] == ["llm"]
    assert not audio_of(events)
    assert isinstance(events[-1], Final) and events[-1].metrics["audio_seconds"] == 0
    (path,) = stages.thinker_files
    assert not os.path.exists(path) and not os.path.exists(path + ".rows")


def test_the_thinkers_file_and_its_row_count_are_removed_after_the_request():
    _, stages = speak()
    (path,) = stages.thinker_files
    assert stages.files_seen_by_talker == [True]
    assert not os.path.exists(path) and not os.path.exists(path + ".rows")


def test_a_failing_talker_fails_the_request_naming_it_and_stops_the_thinker():
    stages = ScriptedStages(reply_tokens=30, fail="talker")
    with pytest.raises(StageFailedError) as err:
        speak(stages)
    assert err.value.role == "talker" and err.value.model == "talker"
    assert "talker refuses" in str(err.value) and err.value.code == "INVALID_ARG"
    assert "llm" in stages.closed_early and not stages.open_streams
    (path,) = stages.thinker_files
    assert not os.path.exists(path)


def test_thinker_rows_are_ready_with_the_file_the_prompt_and_two_reply_tokens():
    async def main():
        rows = ThinkerRows(FAMILY.speech)
        rows.update({LLM.HIDDEN_STATES_FILE: np.array([b"/dev/shm/x"], dtype=np.object_),
                     LLM.NUM_OUTPUT_TOKENS: np.array([1], np.uint32)})
        assert rows.file == "/dev/shm/x" and not rows.ready.is_set()
        rows.update({LLM.INPUT_TOKEN_IDS: np.array([4, 5], np.int64),
                     LLM.NUM_OUTPUT_TOKENS: np.array([0], np.uint32)})
        assert rows.prompt_ids == [4, 5] and not rows.ready.is_set()
        # later responses do not replace what the first ones said
        rows.update({LLM.HIDDEN_STATES_FILE: np.array([b"/other"], dtype=np.object_),
                     LLM.INPUT_TOKEN_IDS: np.array([9], np.int64),
                     LLM.NUM_OUTPUT_TOKENS: np.array([1], np.uint32)})  # each adds its own
        assert rows.ready.is_set() and rows.file == "/dev/shm/x" and rows.prompt_ids == [4, 5]
        assert rows.reply_tokens == 2

    asyncio.run(main())


# --- task "speech": read the text aloud -------------------------------------------------------

def test_speech_reads_the_text_as_the_thinkers_reply_without_generating():
    cfg = config()
    stages = ScriptedStages()
    words = " ".join(f"w{i}" for i in range(15))
    chat = tiny_chat_prompt()
    events = run_events(OmniPipeline(cfg, stages, chat), cfg, text=words, **{OMNI.TASK: "speech"})
    prompt = chat.encode(chat.render(cfg.system_prompt, words))
    (thinker,) = stages.thinker_requests()
    assert LLM.TEXT_INPUT not in thinker
    assert thinker[LLM.PROMPT_TOKEN_IDS].tolist() == prompt + chat.encode(words)
    assert json.loads(thinker[LLM.SAMPLING_PARAMETERS][0]) == {"max_tokens": 1, "temperature": 0.0}
    for name in THINKER_INPUTS:
        assert thinker[name].tolist() == [True]
    # the talker's prompt ends where the text starts: the text is the reply it voices
    (talker,) = stages.talker_requests()
    assert talker[TALKER.PROMPT_TOKEN_IDS].tolist() == prompt
    assert talker[TALKER.THINKER_HIDDEN_STATES_FILE].tolist() == [stages.thinker_files[0].encode()]
    assert not any(isinstance(e, TextDelta) for e in events)
    assert voiced_marks(events) == every_code_in_order()
    final = events[-1]
    assert isinstance(final, Final) and final.finish_reason == "stop"
    assert final.metrics["usage"] == {"prompt_tokens": len(chat.encode(words)),
                                      "completion_tokens": 0}
    assert not os.path.exists(stages.thinker_files[0])


@pytest.mark.parametrize("overrides, task, message", [
    ({}, "sing", "unknown task 'sing'"),
    ({"stages": {"thinker": "llm"}}, "speech", "has no talker to read text aloud"),
])
def test_bad_task_names_the_field(overrides, task, message):
    cfg = config(**overrides)
    with pytest.raises(RequestError, match=re.escape(message)) as info:
        parse_request("r1", tensors(**{OMNI.TASK: task}), cfg)
    assert OMNI.TASK in str(info.value)


def test_chat_reports_the_thinkers_token_counts():
    cfg = config()

    class Counting(ScriptedStages):
        async def stream(self, model, inputs, outputs, *, request_id, timeout_s, unread=None):
            async for out in super().stream(model, inputs, outputs, request_id=request_id,
                                            timeout_s=timeout_s):
                if model == "llm":  # one reply token per response, as the stage counts it
                    out = {**out, LLM.NUM_INPUT_TOKENS: np.array([42], np.uint32),
                           LLM.NUM_OUTPUT_TOKENS: np.array([1], np.uint32)}
                yield out

    events = run_events(OmniPipeline(cfg, Counting(reply_tokens=7), tiny_chat_prompt()), cfg)
    assert events[-1].metrics["usage"] == {"prompt_tokens": 42, "completion_tokens": 7}
