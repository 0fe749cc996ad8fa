"""omni_client (sync, asyncio, CLI) against every preset in a real tritonserver.

Uses the session servers of conftest.py (omni-chat, text-chat, text-to-image);
what is checked is the SDK's view: typed events in order, usage, media, typed
errors, cancellation when the caller stops reading.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni_client import (
    AsyncOmniClient,
    AudioChunk,
    BadRequestError,
    Final,
    ImageOutput,
    OmniClient,
    TextDelta,
)

from .llm_io import cancel_limit, metric, wait_idle
from .omni_io import png, tone, wav

pytestmark = pytest.mark.integration

REPLY_TOKENS = 16
# Greedy and exactly REPLY_TOKENS long (ignore_eos), so the reply is the same each time.
FIXED = dict(max_tokens=REPLY_TOKENS, temperature=0, sampling_parameters={"ignore_eos": True},
             seed=7)
CLI = Path(sys.prefix) / "bin" / "omni-client"


def _running(server, model: str) -> float:
    return metric(server.metrics(), "omni_llm_engine_running_requests", model)


def _generated(server, model: str) -> float:
    return metric(server.metrics(), "omni_llm_generation_tokens_total", model)


def _check_omni_events(events: list) -> None:
    """TextDeltas and AudioChunks, then exactly one Final, last, with the reply's usage."""
    kinds = {type(e) for e in events}
    assert kinds == {TextDelta, AudioChunk, Final}, kinds
    finals = [e for e in events if isinstance(e, Final)]
    assert len(finals) == 1 and events[-1] is finals[0]
    final = finals[0]
    assert final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == REPLY_TOKENS
    assert final.usage.prompt_tokens > 0
    assert final.metrics["usage"]["completion_tokens"] == REPLY_TOKENS
    chunks = [e for e in events if isinstance(e, AudioChunk)]
    for chunk in chunks:
        assert chunk.samples.dtype == np.float32 and chunk.samples.ndim == 1
        assert chunk.sample_rate == 24000
        assert np.isfinite(chunk.samples).all() and np.abs(chunk.samples).max() <= 1.0
    audio_s = sum(c.duration_s for c in chunks)
    assert final.metrics["audio_seconds"] == pytest.approx(audio_s, abs=1e-3)


def _text(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


# --- omni-chat -------------------------------------------------------------------------------


def test_omni_stream_yields_text_audio_then_one_final_and_matches_chat(omni_chat_server):
    with OmniClient(omni_chat_server.grpc_url, model="omni") as client:
        events = list(client.stream("tell me a story", modalities=["text", "audio"], **FIXED))
        reply = client.chat("tell me a story", modalities=["text", "audio"], **FIXED)

    _check_omni_events(events)
    text = _text(events)
    assert text.strip() and text == reply.text
    assert reply.usage.completion_tokens == REPLY_TOKENS and reply.finish_reason == "length"
    assert reply.sample_rate == 24000 and reply.audio.size > 0


def test_list_models_gives_the_entry_models_and_their_kinds(omni_chat_server):
    with OmniClient(omni_chat_server.grpc_url) as client:
        models = {m.name: m for m in client.list_models()}

    kinds = {name: m.kind for name, m in models.items()}
    assert {"omni": "omni", "llm": "llm", "text_to_image": "image"}.items() <= kinds.items()
    assert models["omni"].backend == "omni_orchestrator"
    # stages that only serve the pipeline are no entry models
    assert not {"image_encoder", "audio_encoder", "audio_decoder"} & set(models)


def test_speech_reads_each_text_in_its_own_way(omni_chat_server):
    """The talker reads the text's own rows: another text, other codes. (How long speech
    lasts is the talker's to decide; the random tiny one stops at random.)"""
    short = "Hello there, friend."
    long = ("The quick brown fox jumps over the lazy dog while the patient farmer walks "
            "slowly home across the green hills, carrying apples and bread for supper with "
            "his old friend.")
    assert len(short.split()) == 3 and len(long.split()) == 30
    with OmniClient(omni_chat_server.grpc_url) as client:
        little = client.speech(short, seed=1)
        more = client.speech(long, seed=1)

    for speech in (little, more):
        assert speech.sample_rate == 24000 and speech.samples.dtype == np.float32
        assert np.abs(speech.samples).max() <= 1.0
        assert speech.duration_s > 0
    assert little.samples.shape != more.samples.shape or \
        np.abs(little.samples - more.samples).max() > 1e-2


def test_media_in_from_paths_pil_and_numpy(omni_chat_server, tmp_path):
    path = tmp_path / "in.png"
    path.write_bytes(png(64, 48))
    with OmniClient(omni_chat_server.grpc_url) as client:
        from_path = client.chat("what is in the picture?", image=path, max_tokens=8, temperature=0)
        from_pil = client.chat("what is in the picture?", image=Image.open(path), max_tokens=8,
                               temperature=0)
        from_numpy = client.chat("what do you hear?", audio=tone(0.5), audio_sample_rate=16000,
                                 max_tokens=8, temperature=0)
        from_bytes = client.chat("what do you hear?", audio=wav(tone(0.5)), max_tokens=8,
                                 temperature=0)

    assert from_path.text and from_path.text == from_pil.text
    assert from_numpy.text and from_numpy.text == from_bytes.text
    assert from_path.usage.prompt_tokens > 20  # the image's rows are part of the prompt


@pytest.mark.parametrize(("kwargs", "fragments"), [
    (dict(modalities=["text", "audio"], voice="Nobody"), ("voice: unknown voice", "Nobody")),
    (dict(image=b"\x89PNG\r\n\x1a\n this is not a png"), ("image_encoder", "media:")),
])
def test_bad_input_raises_bad_request_naming_the_field_and_the_next_call_works(
        omni_chat_server, kwargs, fragments):
    with OmniClient(omni_chat_server.grpc_url) as client:
        with pytest.raises(BadRequestError) as caught:
            client.chat("hello", max_tokens=4, temperature=0, **kwargs)
        for fragment in fragments:
            assert fragment in caught.value.message, caught.value.message
        assert client.chat("still there?", max_tokens=4, temperature=0).text


def test_arguments_that_do_not_fit_the_model_fail_before_sending(omni_chat_server, tmp_path):
    with OmniClient(omni_chat_server.grpc_url) as client:
        with pytest.raises(BadRequestError, match="image: cannot read"):
            client.chat("hi", image=tmp_path / "missing.png")
        with pytest.raises(BadRequestError, match="audio"):
            client.chat("hi", model="llm", audio=wav(tone(0.2)))


# --- asyncio ---------------------------------------------------------------------------------


def test_async_stream_gives_the_same_events(omni_chat_server):
    async def run() -> tuple[list, str]:
        async with AsyncOmniClient(omni_chat_server.grpc_url) as client:
            events = [e async for e in client.stream("tell me a story",
                                                     modalities=["text", "audio"], **FIXED)]
            models = {m.name: m.kind for m in await client.list_models()}
            assert models["omni"] == "omni"
            return events, (await client.chat("tell me a story", **FIXED)).text

    events, text = asyncio.run(run())

    _check_omni_events(events)
    assert _text(events) == text


def test_async_cancelling_the_task_cancels_every_engine(omni_chat_server):
    server = omni_chat_server
    long = dict(max_tokens=1900, temperature=0, sampling_parameters={"ignore_eos": True})
    seen: dict = {}  # a timeline, shown when an assertion fails

    async def run() -> tuple[float, float] | None:
        async with AsyncOmniClient(server.grpc_url, timeout=60) as client:
            events: list = []

            async def consume() -> None:
                async with contextlib.aclosing(client.stream(
                        "speak for a long time", modalities=["text", "audio"], **long)) as stream:
                    async for event in stream:
                        events.append(event)

            t0 = time.monotonic()
            task = asyncio.create_task(consume())
            deadline = time.monotonic() + 60
            while not any(isinstance(e, TextDelta) for e in events):  # the thinker runs
                if task.done() or time.monotonic() > deadline:
                    await task
                    return None
                await asyncio.sleep(0.01)
            # until the talker runs too, but at most 1.5 s, while the thinker is still far from
            # its 1900 tokens (a talker's first batched step has taken 8 s on a fresh machine;
            # waiting for it let the thinker finish first)
            deadline = time.monotonic() + 1.5
            while _running(server, "talker") < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            seen["talker running"] = _running(server, "talker")
            seen["cancelled at s"] = round(time.monotonic() - t0, 3)
            seen["text deltas then"] = sum(isinstance(e, TextDelta) for e in events)
            seen["audio chunks then"] = sum(isinstance(e, AudioChunk) for e in events)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            seen["task ended at s"] = round(time.monotonic() - t0, 3)
            seen["text deltas received"] = sum(isinstance(e, TextDelta) for e in events)
            idle = await asyncio.to_thread(wait_idle, server, ("llm", "talker"), ("omni",))
            seen["engines idle at s"] = round(time.monotonic() - t0, 3)
            assert not any(idle.values()), {**seen, **idle}  # no token comes after these:
            tokens = (_generated(server, "llm"), _generated(server, "talker"))
            # and the client still works
            reply = await client.chat("still there?", max_tokens=4, temperature=0)
            assert reply.text
            return tokens

    thinker_before = _generated(server, "llm")
    talker_before = _generated(server, "talker")
    tokens = asyncio.run(run())
    assert tokens is not None, "the stream ended before any text"
    thinker_tokens, talker_codes = tokens
    seen["thinker tokens"] = thinker_tokens - thinker_before
    seen["talker codes"] = talker_codes - talker_before
    # Both engines stopped early: of what the thinker had left to generate when the cancel was
    # sent, it generated less than half (the whole reply: 1900 tokens and ~7600 codes). The
    # orchestrator merges deltas when its sender is busy, so the deltas received count fewer
    # tokens than were sent: the bound is stricter than that, never looser.
    limit = cancel_limit(seen["text deltas then"], long["max_tokens"])
    assert 0 < thinker_tokens - thinker_before < limit, seen
    assert talker_codes - talker_before < long["max_tokens"] * 4 / 2, seen


# --- text-chat -------------------------------------------------------------------------------


def test_text_chat_stream_gives_text_deltas_and_a_final_with_usage(text_chat_server):
    with OmniClient(text_chat_server.grpc_url) as client:
        events = list(client.stream("Tell me about the sea", model="llm", max_tokens=8,
                                    temperature=0, sampling_parameters={"ignore_eos": True}))
        default = client.chat("Tell me about the sea", max_tokens=8, temperature=0,
                              sampling_parameters={"ignore_eos": True})  # the only entry: llm
        models = client.list_models()

    assert [type(e) for e in events[:-1]] == [TextDelta] * (len(events) - 1) and len(events) > 2
    final = events[-1]
    assert isinstance(final, Final) and final.finish_reason == "length"
    assert final.usage.completion_tokens == 8 and final.usage.prompt_tokens > 0
    assert default.text == _text(events) and default.usage == final.usage
    assert [(m.name, m.kind) for m in models] == [("llm", "llm")]


def test_text_chat_refuses_media_before_sending(text_chat_server):
    with OmniClient(text_chat_server.grpc_url) as client:
        with pytest.raises(BadRequestError, match="image"):
            client.chat("hi", model="llm", image=png())
        assert client.chat("hi", model="llm", max_tokens=2).text is not None


# --- text-to-image ---------------------------------------------------------------------------


def test_generate_image_gives_a_png_of_the_asked_size_the_same_for_the_same_seed(
        text_to_image_server):
    with OmniClient(text_to_image_server.grpc_url) as client:
        first = client.generate_image("a red fox in the snow", width=64, height=48, seed=11)
        again = client.generate_image("a red fox in the snow", width=64, height=48, seed=11)
        other = client.generate_image("a red fox in the snow", width=64, height=48, seed=12)
        events = list(client.stream("a red fox in the snow", model="text_to_image", seed=11))

    assert first.png[:8] == b"\x89PNG\r\n\x1a\n"
    assert first.to_pil().size == (64, 48)
    assert first.png == again.png and first.png != other.png
    assert [type(e) for e in events] == [ImageOutput, Final]
    assert Image.open(io.BytesIO(events[0].png)).size == (64, 64)  # the spec's default
    assert events[1] == Final(None)


def test_a_bad_image_size_is_a_bad_request_naming_it(text_to_image_server):
    with OmniClient(text_to_image_server.grpc_url) as client:
        with pytest.raises(BadRequestError, match="width"):
            client.generate_image("a fox", width=30, height=32)
        assert client.generate_image("a fox", width=32, height=32).to_pil().size == (32, 32)


# --- the CLI ---------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=300)


def test_cli_chat_prints_the_reply_and_writes_a_wav(omni_chat_server, tmp_path):
    path = tmp_path / "reply.wav"

    # the talker samples (the family's defaults): seeded, or the tiny random talker's
    # first code is a stop code for some seeds (2 and 3: "the reply came without audio")
    done = _cli("chat", "hi", "--audio-out", str(path), "--url", omni_chat_server.grpc_url,
                "--max-tokens", "12", "--temperature", "0", "--seed", "0")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    info = sf.info(path)
    assert info.samplerate == 24000 and info.channels == 1 and info.frames > 0
    samples, _ = sf.read(path, dtype="float32")
    assert np.abs(samples).max() <= 1.0
    (summary,) = done.stderr.splitlines()  # not a terminal: one summary line
    assert "first token" in summary and "audio" in summary and f"wrote {path}" in summary


def test_cli_image_writes_a_png(text_to_image_server, tmp_path):
    path = tmp_path / "out.png"

    done = _cli("--url", text_to_image_server.grpc_url, "image", "a red square", "-o", str(path),
                "--size", "64x32", "--seed", "3")

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {path} (64x32) in ")
    assert Image.open(path).format == "PNG" and Image.open(path).size == (64, 32)


def test_cli_errors_exit_with_their_code(text_to_image_server, tmp_path):
    bad = _cli("--url", text_to_image_server.grpc_url, "image", "x", "-o", str(tmp_path / "a.png"),
               "--size", "30x32")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "width" in bad.stderr
    assert "Traceback" not in bad.stderr
    listed = _cli("models", "--url", text_to_image_server.grpc_url)
    assert listed.returncode == 0 and "text_to_image  image  omni_dit" in listed.stdout
