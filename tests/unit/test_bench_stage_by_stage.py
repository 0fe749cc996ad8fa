"""omni-bench pipelining's baseline (omni_tools.bench.stage_by_stage) with scripted stages:
each speech stage runs to its end before the next starts, and the audio is the same."""
from __future__ import annotations

import ast

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from omni_serve.contract import OMNI
from omni_tools.bench.stage_by_stage import ENTRY_MODEL_PY, StageByStagePipeline, install
from tests.unit.chat import tiny_chat_prompt
from tests.unit.test_orchestrator import ScriptedStages, code_at, config
from tests.unit.test_orchestrator_speech import (
    CHUNKS,
    TALKER_CODES,
    every_code_in_order,
    run_events,
    voiced_marks,
)


def speak_stage_by_stage(stages: ScriptedStages, **extra) -> list:
    cfg = config(parallel_chunks=1)  # as the benchmark's entry model has it
    extra.setdefault(OMNI.MODALITIES, ["text", "audio"])
    return run_events(StageByStagePipeline(cfg, stages, tiny_chat_prompt()), cfg, **extra)


def test_the_talker_starts_after_the_thinker_and_the_decoder_after_the_talker():
    stages = ScriptedStages(reply_tokens=12)
    speak_stage_by_stage(stages)
    log = stages.log
    assert log.index("talker") >= stages.thinker_done_at  # the whole reply first
    assert log.index("audio") > log.index("talker done")  # then all the codes
    assert log.count("audio") == len(CHUNKS)


def test_the_decoder_gets_the_same_chunks_and_every_code_is_voiced_once_in_order():
    stages = ScriptedStages()
    events = speak_stage_by_stage(stages, seed=5)
    assert [(offset, context, lookahead) for _, context, lookahead, offset, _ in stages.decoded] \
        == [(offset, context, lookahead) for offset, context, lookahead, _ in CHUNKS]
    assert {seed for *_, seed in stages.decoded} == {5}
    assert voiced_marks(events) == every_code_in_order()
    assert set(events[-1].metrics["stage_seconds"]) == {"thinker", "talker", "audio_decoder"}


def test_without_streamed_audio_all_codes_go_to_the_decoder_in_one_call():
    stages = ScriptedStages()
    speak_stage_by_stage(stages, stream_audio=False)
    ((codes, context, lookahead, offset, _),) = stages.decoded
    assert codes == [code_at(p) for p in range(TALKER_CODES)]
    assert (context, lookahead, offset) == (0, 0, 0)


def test_text_only_requests_never_wait_for_a_talker():
    stages = ScriptedStages(reply_tokens=4)
    speak_stage_by_stage(stages, modalities=["text"])
    assert "talker" not in stages.log and not stages.decoded


def test_install_makes_the_generated_orchestrator_a_python_model_of_this_baseline(tmp_path):
    config_pbtxt = ('name: "omni_sequential"\nbackend: "omni_orchestrator"\n'
                    'model_transaction_policy { decoupled: true }\n'
                    'parameters { key: "entry" value { string_value: "1" } }\n')
    (tmp_path / "config.pbtxt").write_text(config_pbtxt)
    (tmp_path / "1").mkdir()
    install(tmp_path)
    written = text_format.Parse((tmp_path / "config.pbtxt").read_text(),
                                model_config_pb2.ModelConfig())
    before = text_format.Parse(config_pbtxt, model_config_pb2.ModelConfig())
    before.backend = "python"
    assert written == before  # only the backend changed
    model_py = (tmp_path / "1" / "model.py").read_text()
    assert model_py == ENTRY_MODEL_PY
    tree = ast.parse(model_py)
    imported = [(node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names]
    assert imported == [("omni_tools.bench.stage_by_stage", "entry_model")]
    assert "TritonPythonModel = entry_model()" in model_py
