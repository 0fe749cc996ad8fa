"""A Qwen2.5-Omni folder without the speech parts serves text and refuses audio (real server).

The folder is the tiny default minus `talker.*`, `token2wav.*` and
`spk_dict.pt` (what a thinker-only export ships); `omni-gen-repo --preset
omni-chat --model DIR` leaves the talker and the audio decoder out.
(Qwen3-Omni's Thinking folder is served in test_qwen3_omni, beside that family's
other stages.)

It loads its models into the session's text-to-image server (servers.loaded): the
repository is the omni-chat preset's, model for model and name for name, and the
omni-chat server has those names; the text-to-image server has only `text_to_image`,
the same tiny Qwen-Image model, which the repository's orchestrator calls there.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from omni_tools import tiny_models

from .omni_io import error_code, run_omni
from .servers import gen_repo, loaded

pytestmark = pytest.mark.integration

SPEECH_PREFIXES = ("talker.", "token2wav.")


def _text_only_copy(source: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for path in source.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", "spk_dict.pt"):
            shutil.copy2(path, out / path.name)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith(SPEECH_PREFIXES)},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def server(text_to_image_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("text-only")
    folder = _text_only_copy(tiny_models.ensure_model("qwen2.5-omni-tiny"), root / "checkpoint")
    repo = gen_repo(["--preset", "omni-chat", "--model", folder], root / "repo")
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == [
        "audio_encoder", "image_encoder", "llm", "omni", "text_to_image"]  # no speech stages
    # what is tested here is which stages the generator writes, not the compiled engine
    # the session's omni-chat server already runs: an eager engine loads in half the time
    engine = repo / "llm" / "engine.json"
    engine.write_text(json.dumps({**json.loads(engine.read_text()), "enforce_eager": True}))
    with loaded(text_to_image_server, repo,
                [("llm", "image_encoder", "audio_encoder", "omni")]) as server:
        yield server


def test_text_is_served_and_audio_is_refused_clearly(server):
    url = server.grpc_url
    text = run_omni(url, text="hello", sampling={"temperature": 0, "max_tokens": 8})
    assert text.error is None and text.text and text.metrics["usage"]["completion_tokens"] > 0
    audio = run_omni(url, text="hello", modalities=["text", "audio"],
                     sampling={"temperature": 0, "max_tokens": 8})
    assert error_code(audio.error) == "INVALID_ARG"
    message = str(audio.error)
    assert "modalities" in message and "talker" in message and "audio_decoder" in message
    assert run_omni(url, text="still serving?", sampling={"temperature": 0, "max_tokens": 4}).error \
        is None
