"""A folder without the speech parts serves text and refuses audio (real server), per family.

Qwen2.5-Omni: the tiny default minus `talker.*`, `token2wav.*` and `spk_dict.pt` (what a
thinker-only export ships). Qwen3-Omni: the tiny Thinking folder as the hub ships
Qwen3-Omni-30B-A3B-Thinking (`enable_audio_output` false, no talker or Code2Wav weights),
whose reply also equals transformers' on the same folder. `omni-gen-repo --preset
omni-chat --model DIR` leaves the talker and the audio decoder out.

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


def _qwen25_text_only(root: Path) -> Path:
    return _text_only_copy(tiny_models.ensure_model("qwen2.5-omni-tiny"), root / "checkpoint")


def _qwen3_thinking(root: Path) -> Path:
    return tiny_models.ensure_model("qwen3-omni-thinking-tiny")


# family -> (its text-only folder, the stages the generator writes: no speech stages;
# Qwen3-Omni's thinker takes images and audio raw, so it has no encoder stages)
FOLDERS = {
    "qwen2.5-omni": (_qwen25_text_only, ("audio_encoder", "image_encoder", "llm", "omni")),
    "qwen3-omni-thinking": (_qwen3_thinking, ("llm", "omni")),
}


@pytest.fixture(scope="module", params=list(FOLDERS))
def folder_and_server(request, text_to_image_server, tmp_path_factory):
    make_folder, stages = FOLDERS[request.param]
    root = tmp_path_factory.mktemp("text-only")
    folder = make_folder(root)
    repo = gen_repo(["--preset", "omni-chat", "--model", folder], root / "repo")
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == sorted(
        [*stages, "text_to_image"])
    # what is tested here is which stages the generator writes, not the compiled engine
    # the session's omni-chat server already runs: an eager engine loads in half the time
    engine = repo / "llm" / "engine.json"
    engine.write_text(json.dumps({**json.loads(engine.read_text()), "enforce_eager": True}))
    with loaded(text_to_image_server, repo, [stages]) as server:
        yield request.param, folder, server


def test_text_is_served_and_audio_is_refused_clearly(folder_and_server):
    family, folder, server = folder_and_server
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


def test_a_qwen3_thinking_reply_equals_transformers(folder_and_server):
    family, folder, server = folder_and_server
    if family != "qwen3-omni-thinking":
        pytest.skip("Qwen2.5-Omni's replies are checked against transformers in test_omni_chat")
    import torch

    from tests.qwen3_reference import load, processor_inputs

    model, processor = load(str(folder))
    question, greedy = "what is the weather like?", {"temperature": 0, "max_tokens": 12}
    inputs = processor_inputs(processor, [{"role": "user", "content": [
        {"type": "text", "text": question}]}])
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=greedy["max_tokens"], do_sample=False,
                                     eos_token_id=processor.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    want = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    result = run_omni(server.grpc_url, text=question, sampling=greedy)
    assert result.error is None, result.error
    # vLLM holds back a reply's last bytes while they are no whole UTF-8 character
    assert result.text == want.removesuffix("\ufffd")
