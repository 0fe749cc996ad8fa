"""A talker engine's vLLM generation config holds its own stop codes, not the thinker's
eos ids (families/talker_generation.py), for both families."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_serve.families.qwen2_5_omni import talker_prompt as qwen25
from omni_serve.families.qwen3_omni_moe import talker_prompt as qwen3

CONFIGS = {
    qwen25: ({"talker_config": {"vocab_size": 8448, "tts_codec_pad_token_id": 8292,
                                "tts_codec_end_token_id": 8294}}, [8292, 8294]),
    qwen3: ({"talker_config": {"codec_eos_token_id": 2150, "text_config": {"vocab_size": 3072}}},
            [2150]),
}


@pytest.mark.parametrize("family", CONFIGS, ids=["qwen2.5-omni", "qwen3-omni"])
def test_the_talker_stops_on_its_own_codes(family, tmp_path: Path):
    config, stops = CONFIGS[family]
    (tmp_path / "config.json").write_text(json.dumps(config))
    # the checkpoint's own file is the thinker's: text eos ids a codec vocabulary reaches
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    args = family.engine_args({"model": str(tmp_path)})
    folder = Path(args["generation_config"])
    assert folder != tmp_path
    assert json.loads((folder / "generation_config.json").read_text()) == {"eos_token_id": stops}
    named = family.engine_args({"model": str(tmp_path), "generation_config": str(tmp_path)})
    assert named["generation_config"] == str(tmp_path)  # a folder the spec names is kept


def test_the_folder_is_the_same_in_every_process_for_the_same_codes():
    """vLLM's compile cache key hashes the generation_config path: a path of its own per
    start would compile the talker from scratch at every start."""
    import subprocess
    import sys

    from omni_serve.families.talker_generation import talker_generation_config

    here = talker_generation_config([8292, 8294])
    there = subprocess.run(
        [sys.executable, "-c", "from omni_serve.families.talker_generation import "
         "talker_generation_config as t; print(t([8292, 8294]))"],
        check=True, capture_output=True, text=True).stdout.strip()
    assert there == here
    other = talker_generation_config([2150])
    assert other != here
    assert json.loads((Path(other) / "generation_config.json").read_text()) == {
        "eos_token_id": [2150]}
    assert json.loads((Path(here) / "generation_config.json").read_text()) == {
        "eos_token_id": [8292, 8294]}
