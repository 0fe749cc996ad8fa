"""Stage logic of the omni_audio stage: config, request parsing, chunk plans, batched runs.

Runs the tiny random-weight Qwen2.5-Omni checkpoint's Token2Wav, the family's
codec decoder (families/qwen2_5_omni/token2wav.py; 480 samples per code at
24 kHz), on CPU, with 3 ODE time points except where the model's
own settings are the point (goldens against transformers, chunking). Batched
and lone runs are compared with a tolerance of 1e-5 on samples in [-1, 1]:
oneDNN convolutions and GEMMs sum in another order for another batch size
(measured: about 2.5e-6 at most).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import (
    AudioLimits,
    AudioRequest,
    ChunkContext,
    ChunkSpan,
    chunk_plan,
    parse_request,
)
from omni_serve.audio.runner import AudioRunner, real_time_factor
from omni_serve.contract import AUDIO, ENGINE_ARGS_FILE
from omni_serve.errors import RequestError
from omni_serve.families.qwen2_5_omni.token2wav import LastCallMemo, sample_mel
from omni_serve.families.qwen2_5_omni.token2wav_context import (
    dit_context_codes,
    ode_dit_passes,
    vocoder_context_frames,
)
from omni_tools.tiny_token2wav import TINY_BIGVGAN, TINY_DIT

torch.set_num_threads(1)

STEPS = 3
TOLERANCE = 1e-5
SPC = 480  # samples per code of the real architecture (2 mel frames x 240)
LIMITS = AudioLimits(codec_vocab=512, voices=("Chelsie", "Ethan"), default_voice="Chelsie",
                     max_codec_tokens=64)
RNG = np.random.default_rng(0)
STREAM = RNG.integers(0, 512, (96, 1))  # [frames, 1]: one code a frame


def tensors(codes=(1, 2, 3), **extra) -> dict[str, np.ndarray | None]:
    """The request's tensors; a flat list of codes is sent as [frames, 1]."""
    if codes is not None:
        codes = np.asarray(codes)
        codes = codes.reshape(-1, 1) if codes.ndim == 1 else codes
    out: dict[str, np.ndarray | None] = {AUDIO.CODEC_IDS: codes}
    dtypes = {AUDIO.CONTEXT_TOKENS: np.int32, AUDIO.SEED: np.int64, AUDIO.CODE_OFFSET: np.int64}
    for name, value in extra.items():
        if isinstance(value, str):
            out[name] = np.array([value.encode()], dtype=object)
        else:
            out[name] = np.array([value], dtype=dtypes[name])
    return out


def req(n: int = 16, seed: int = 1, context: int = 0, voice: str = "Chelsie", start: int = 0,
        lookahead: int = 0) -> AudioRequest:
    return AudioRequest(codes=STREAM[start:start + n], context=context, voice=voice, seed=seed,
                        lookahead=lookahead)


# --- config ----------------------------------------------------------------------
def test_config_defaults_and_unknown_keys_are_an_error():
    cfg = AudioStageConfig(model="m")
    assert (cfg.num_steps, cfg.guidance_scale, cfg.sway_coefficient) == (None, None, None)
    assert cfg.dtype == "float32" and cfg.device == "cpu" and cfg.default_voice is None
    with pytest.raises(ValidationError, match="extra"):
        AudioStageConfig(model="m", steps=3)
    with pytest.raises(ValidationError, match="num_steps"):
        AudioStageConfig(model="m", num_steps=1)
    with pytest.raises(ValidationError, match="device"):
        AudioStageConfig(model="m", device="tpu")
    with pytest.raises(ValidationError, match="default_voice=' Ethan'"):
        AudioStageConfig(model="m", default_voice=" Ethan")


def test_the_old_name_of_default_voice_is_an_error_naming_the_new_one():
    with pytest.raises(ValidationError, match="default_speaker: renamed to default_voice"):
        AudioStageConfig(model="m", default_speaker="Ethan")


# --- request parsing ---------------------------------------------------------------
def test_defaults_fill_missing_fields():
    r = parse_request(tensors([[[5], [6], [7]]]), LIMITS)  # [1, frames, 1] as the batcher delivers it
    assert r.codes.tolist() == [[5], [6], [7]] and r.codes.dtype == np.int64
    assert (r.context, r.voice, r.offset, r.lookahead, r.new_codes) == (0, "Chelsie", 0, 0, 3)
    assert parse_request(tensors(), LIMITS).seed != parse_request(tensors(), LIMITS).seed


def test_given_fields_are_kept():
    r = parse_request(tensors([0, 511, 9], context_tokens=2, voice="Ethan", seed=-3), LIMITS)
    assert (r.context, r.voice, r.seed, r.new_codes) == (2, "Ethan", -3, 1)


@pytest.mark.parametrize(("inputs", "field", "message"), [
    (tensors(None), AUDIO.CODEC_IDS, "is required"),
    (tensors(np.zeros((1, 0, 1), np.int64)), AUDIO.CODEC_IDS, "must not be empty"),
    (tensors([[1, 2], [3, 4]]), AUDIO.CODEC_IDS, r"expected shape \[frames, 1\] .* got \[2, 2\]"),
    (tensors() | {AUDIO.CODEC_IDS: np.arange(3)}, AUDIO.CODEC_IDS,
     r"expected shape \[frames, 1\] \(1 code a frame\), got \[3\]"),
    (tensors([1.0, 2.0]), AUDIO.CODEC_IDS, "must be integers"),
    (tensors([3, 512]), AUDIO.CODEC_IDS, r"codes must be in \[0, 512\), got 512 at frame 1"),
    (tensors([-1, 4]), AUDIO.CODEC_IDS, r"codes must be in \[0, 512\), got -1 at frame 0"),
    (tensors(range(65)), AUDIO.CODEC_IDS, "at most 64 frames per request .* got 65"),
    (tensors(context_tokens=-1), AUDIO.CONTEXT_TOKENS, "must be between 0 and 2 .* got -1"),
    (tensors(context_tokens=3), AUDIO.CONTEXT_TOKENS, "must be between 0 and 2 .* got 3"),
    (tensors(voice="Nobody"), AUDIO.VOICE, "unknown voice 'Nobody'; known voices: Chelsie, Ethan"),
    (tensors(voice="x") | {AUDIO.VOICE: np.array([b"\xff"], dtype=object)}, AUDIO.VOICE,
     "not valid UTF-8"),
    (tensors() | {AUDIO.SEED: np.array([1.5])}, AUDIO.SEED, "must be an integer"),
    (tensors() | {AUDIO.CONTEXT_TOKENS: np.array([1, 2], dtype=np.int32)}, AUDIO.CONTEXT_TOKENS,
     "expected exactly one element"),
])
def test_each_bad_field_is_named_with_its_problem(inputs, field, message):
    with pytest.raises(RequestError, match=message) as info:
        parse_request(inputs, LIMITS)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


# --- chunk plans -------------------------------------------------------------------
def stream_plan(total: int, arrivals: list[int], **kw) -> list[ChunkSpan]:
    """Feed the planner a growing stream (`arrivals` = total so far after each talker step)."""
    spans: list[ChunkSpan] = []
    for i, so_far in enumerate(arrivals):
        emitted = spans[-1].end if spans else 0
        spans += chunk_plan(so_far, emitted, final=(i == len(arrivals) - 1), **kw)
    assert arrivals[-1] == total
    return spans


@pytest.mark.parametrize("kw", [
    dict(chunk=16, left_context=0), dict(chunk=16, left_context=4), dict(chunk=10, left_context=16),
    dict(chunk=16, left_context=8, right_context=12, align=12), dict(chunk=1, left_context=3),
])
def test_chunk_plan_voices_every_code_once_in_order(kw):
    arrivals = [3, 3, 17, 40, 41, 70, 95, 100]
    spans = stream_plan(100, arrivals, **kw)
    assert [c for s in spans for c in range(s.begin, s.end)] == list(range(100))
    for s in spans:
        assert 0 <= s.first <= s.begin and s.context <= max(kw["left_context"] + kw.get("align", 1) - 1, 0)
        assert s.context >= min(kw["left_context"], s.begin) and s.first % kw.get("align", 1) == 0
        assert s.last <= 100 and s.end - s.begin <= kw["chunk"]


def test_chunk_plan_waits_for_full_chunks_and_right_context_until_final():
    assert chunk_plan(15, 0, 16, 4, final=False) == []
    assert chunk_plan(40, 0, 16, 4, final=False) == [ChunkSpan(0, 0, 16), ChunkSpan(16, 4, 32)]
    assert chunk_plan(40, 32, 16, 4, final=True) == [ChunkSpan(32, 4, 40)]
    assert chunk_plan(27, 0, 16, 4, final=False, right_context=12) == []
    assert chunk_plan(30, 0, 16, 4, final=True, right_context=12) == [ChunkSpan(0, 0, 16, 12),
                                                                     ChunkSpan(16, 4, 30, 0)]
    assert chunk_plan(40, 16, 16, 4, final=False, align=12) == [ChunkSpan(16, 4, 32)]
    assert chunk_plan(40, 16, 16, 5, final=False, align=12) == [ChunkSpan(16, 16, 32)]
    assert chunk_plan(7, 7, 16, 4, final=True) == []
    with pytest.raises(ValueError, match="emitted=9"):
        chunk_plan(8, 9, 16, 4, final=True)
    with pytest.raises(ValueError, match="chunk=0"):
        chunk_plan(8, 0, 0, 4, final=True)


# --- context for chunks --------------------------------------------------------------
REAL = {"dit": dict(block_size=24, look_backward_layers=[0, 20], look_ahead_layers=[10], num_hidden_layers=22,
                    repeats=2),
        "bigvgan": dict(upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4],
                        resblock_kernel_sizes=[3, 7, 11], resblock_dilation_sizes=[[1, 3, 5]] * 3)}


def test_context_covers_the_dit_blocks_and_the_vocoder_field_of_each_checkpoint():
    assert dit_context_codes(REAL["dit"]) == ChunkContext(24, 23, 12)  # 2 blocks back, 1 ahead
    assert dit_context_codes(REAL["dit"], REAL["bigvgan"]) == ChunkContext(41, 40, 12)
    assert dit_context_codes(REAL["dit"], REAL["bigvgan"], passes=2) == ChunkContext(65, 52, 12)
    assert dit_context_codes(TINY_DIT, TINY_BIGVGAN) == ChunkContext(21, 32, 12)
    assert dit_context_codes(dict(TINY_DIT, block_size=5, repeats=2)).align == 5  # blocks of 2.5 codes
    assert vocoder_context_frames(REAL["bigvgan"]) == (34, 34) and ode_dit_passes(10) == 36
    with pytest.raises(ValueError, match="passes >= 1"):
        dit_context_codes(TINY_DIT, passes=0)


@pytest.mark.parametrize("dit", [TINY_DIT, REAL["dit"], dict(TINY_DIT, block_size=5, repeats=2)])
def test_with_that_context_every_voiced_frame_sees_its_whole_decode_blocks(dit):
    """Brute force over chunk boundaries: the blocks a voiced frame's mel depends on are all sent, whole."""
    ctx = dit_context_codes(dit)
    r, bs = dit["repeats"], dit["block_size"]
    back, ahead = len(dit["look_backward_layers"]), len(dit["look_ahead_layers"])
    for begin in range(0, 90):
        for end in range(begin + 1, begin + 30):
            span = chunk_plan(end + 200, begin, end - begin, ctx.left, False,
                              right_context=ctx.right, align=ctx.align)[0]
            assert span.first * r % bs == 0
            needed_first = max(0, (begin * r // bs - back) * bs)
            needed_last = ((end * r - 1) // bs + ahead + 1) * bs
            assert span.first * r <= needed_first and span.last * r >= needed_last, (begin, end, span)


def test_the_vocoder_field_is_what_its_convolutions_read(runner):
    """Moving a mel frame just outside the field leaves a frame's samples bit-identical."""
    t2w = runner.decoder
    before, after = vocoder_context_frames(t2w.model.config.bigvgan_config)
    vocoder = t2w.vocoder.double()
    try:
        captured: list[torch.Tensor] = []
        handle = vocoder.conv_post.register_forward_hook(lambda _m, _i, out: captured.append(out))
        mel = torch.randn(1, 80, 100, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 3
        frame, spf = 50, t2w.samples_per_mel_frame
        with torch.inference_mode():
            vocoder(mel)
            for moved, inside in ((frame - before - 1, False), (frame + after + 1, False),
                                  (frame - 3, True), (frame + 3, True)):
                nudged = mel.clone()
                nudged[:, :, moved] += 0.5
                vocoder(nudged)
            base, *outs = (c[0, 0, frame * spf:(frame + 1) * spf] for c in captured)
        handle.remove()
        assert [not torch.equal(o, base) for o in outs] == [False, False, True, True]
    finally:
        t2w.vocoder.float()


# --- runner ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(tiny_omni_checkpoint) -> AudioRunner:
    return AudioRunner(AudioStageConfig(model=str(tiny_omni_checkpoint), num_steps=STEPS,
                                        max_codec_tokens=128))


@pytest.fixture(scope="module")
def own_runner(tiny_omni_checkpoint) -> AudioRunner:
    """The checkpoint's own sampler settings (transformers' defaults)."""
    return AudioRunner(AudioStageConfig(model=str(tiny_omni_checkpoint), max_codec_tokens=128))


@pytest.fixture(scope="module")
def reference(tiny_omni_checkpoint):
    """transformers' whole Qwen2.5-Omni model and its voices, as a user would load them."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni_checkpoint).eval()
    return model, torch.load(tiny_omni_checkpoint / "spk_dict.pt", weights_only=True)


def test_runner_reads_limits_and_timing_from_the_checkpoint(runner, own_runner):
    assert runner.limits == AudioLimits(codec_vocab=512, voices=("Chelsie", "Ethan"),
                                        default_voice="Chelsie", max_codec_tokens=128,
                                        max_utterance_codes=16384)
    assert (runner.sample_rate, runner.samples_per_code, runner.context.align) == (24000, SPC, 12)
    assert runner.context == ChunkContext(21, 32, 12)
    own = own_runner.decoder
    assert (own.num_steps, own.guidance_scale, own.sway_coefficient) == (10, 0.5, -1.0)
    assert real_time_factor(0.5, 24000, runner.sample_rate) == 0.5


def _copy(folder: Path, out: Path, *, drop_file: str | None = None, drop_key: str | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for p in folder.iterdir():
        if p.is_file() and p.name not in (drop_file, "model.safetensors"):
            (out / p.name).symlink_to(p)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != drop_key}, str(out / "model.safetensors"))
    return out


def test_runner_rejects_settings_the_checkpoint_cannot_serve(tiny_omni_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="default_voice='Nobody' .* known voices: Chelsie, Ethan"):
        AudioRunner(AudioStageConfig(model=str(tiny_omni_checkpoint), default_voice="Nobody"))
    with pytest.raises(ValueError, match="max_codec_tokens=20000 exceeds the 16384 frames"):
        AudioRunner(AudioStageConfig(model=str(tiny_omni_checkpoint), max_codec_tokens=20000))
    with pytest.raises(FileNotFoundError, match="spk_dict.pt is missing"):
        AudioRunner(AudioStageConfig(model=str(_copy(tiny_omni_checkpoint, tmp_path / "a",
                                                     drop_file="spk_dict.pt"))))
    key = "token2wav.code2wav_bigvgan_model.conv_post.weight"
    with pytest.raises(ValueError, match=f"1 missing \\({key}\\), 0 unexpected"):
        AudioRunner(AudioStageConfig(model=str(_copy(tiny_omni_checkpoint, tmp_path / "b", drop_key=key))))
    other = tmp_path / "qwen2"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="model_type 'qwen2' is not a model family this server serves"):
        AudioRunner(AudioStageConfig(model=str(other)))


def test_the_stand_alone_token2wav_folder_still_loads(tiny_omni_checkpoint, runner):
    old = AudioRunner(AudioStageConfig(model=str(tiny_omni_checkpoint.parent / "token2wav"), num_steps=STEPS))
    assert old.limits.voices == runner.limits.voices
    assert old.run([req(12, seed=2)])[0].tobytes() == runner.run([req(12, seed=2)])[0].tobytes()


@pytest.mark.parametrize("voice", ["Chelsie", "Ethan"])
@pytest.mark.parametrize("n", [17, 60])
def test_a_whole_utterance_is_what_transformers_token2wav_gives(own_runner, reference, voice, n):
    model, voices = reference
    (got,) = own_runner.run([AudioRequest(codes=STREAM[:n], context=0, voice=voice, seed=23)])
    torch.manual_seed(23)
    with torch.inference_mode():
        want = model.token2wav(torch.from_numpy(STREAM[None, :n, 0]), conditioning=voices[voice]["cond"],
                               reference_mel=voices[voice]["ref_mel"]).numpy()
    assert got.shape == want.shape == (n * SPC,)
    assert np.abs(got - want).max() <= 1e-4 and want.std() > 0.01


def test_an_unknown_voice_names_the_checkpoint_voices(runner):
    with pytest.raises(RequestError, match="unknown voice 'Nobody'; known voices: Chelsie, Ethan"):
        parse_request(tensors(voice="Nobody"), runner.limits)
    with pytest.raises(RequestError, match="must be between 0 and 16381 .* at most 16384 frames"):
        parse_request(tensors(code_offset=16382), runner.limits)


def test_sampler_matches_the_library_forward_given_the_same_noise(runner):
    t2w = runner.decoder
    voice = t2w.voices_by_name["Ethan"]
    codes = torch.from_numpy(STREAM[None, :12, 0])
    torch.manual_seed(5)
    noise = torch.randn(1, 24, t2w.mel_dim)
    torch.manual_seed(5)
    with torch.inference_mode():
        want = t2w.model(codes, voice.cond, voice.ref_mel, num_steps=STEPS)
        got = t2w.vocoder(sample_mel(t2w.dit, voice.cond, voice.ref_mel, codes, noise, num_steps=STEPS,
                                     guidance_scale=0.5, sway_coefficient=-1.0))
    assert torch.equal(want, got)


def test_the_speaker_encoder_runs_once_per_voice_and_changes_no_sample(runner, monkeypatch):
    embed = runner.decoder.dit.input_embed
    memo = embed.spk_encoder
    assert isinstance(memo, LastCallMemo)
    calls = []
    inner_forward = memo.inner.forward
    monkeypatch.setattr(memo.inner, "forward", lambda x: calls.append(x.shape) or inner_forward(x))
    memo.forget()
    ethan = runner.run([req(12, seed=3, voice="Ethan")])[0]
    assert len(calls) == 1  # STEPS time points, 4 DiT evaluations per interval, one encoder run
    runner.run([req(12, seed=3, voice="Ethan")])
    assert len(calls) == 1
    chelsie = runner.run([req(12, seed=3, voice="Chelsie")])[0]
    assert len(calls) == 2 and np.abs(chelsie - ethan).max() > 1e-3  # another reference mel: run again
    embed.spk_encoder = memo.inner
    try:
        unwrapped = runner.run([req(12, seed=3, voice="Ethan")])[0]
    finally:
        embed.spk_encoder = memo
    assert unwrapped.tobytes() == ethan.tobytes()
    assert len(calls) == 2 + 4 * (STEPS - 1)  # unwrapped: once per DiT evaluation


def test_output_is_the_audio_of_the_codes_after_the_context(runner):
    whole, trimmed, both_sides = runner.run([req(20, seed=3), req(20, seed=3, context=5),
                                             req(20, seed=3, context=5, lookahead=4)])
    assert whole.shape == (20 * SPC,) and trimmed.shape == (15 * SPC,) and both_sides.shape == (11 * SPC,)
    assert whole.dtype == np.float32
    np.testing.assert_allclose(trimmed, whole[5 * SPC:], atol=TOLERANCE)
    np.testing.assert_allclose(both_sides, whole[5 * SPC:16 * SPC], atol=TOLERANCE)
    assert np.isfinite(whole).all() and np.abs(whole).max() <= 1.0 and whole.std() > 0.01


def test_a_seeded_chunk_sounds_the_same_alone_or_batched(runner):
    one = req(16, seed=7, context=4, start=10)
    (alone,) = runner.run([one])
    batched = runner.run([req(16, seed=8, voice="Ethan", start=40), one, req(16, seed=9)])
    assert np.abs(batched[1] - alone).max() <= TOLERANCE
    assert np.abs(batched[0] - batched[2]).max() > 0.01  # batch-mates are different audio


def test_lengths_split_into_groups_in_request_order(runner, monkeypatch):
    calls: list[int] = []
    real = runner._decode
    monkeypatch.setattr(runner, "_decode", lambda group: calls.append(len(group)) or real(group))
    out = runner.run([req(16, seed=1), req(12, seed=2), req(16, seed=3, context=2)])
    assert sorted(calls) == [1, 2]
    assert [o.size // SPC for o in out] == [16, 12, 14]


def test_a_failing_group_does_not_fail_other_requests(runner, monkeypatch):
    good = [req(16, seed=1), req(16, seed=2, voice="Ethan")]
    expected = runner.run(good)
    real = runner._decode

    def fail_on_12(group):
        if len(group[0].codes) == 12:
            raise RuntimeError("boom on 12 codes")
        return real(group)

    monkeypatch.setattr(runner, "_decode", fail_on_12)
    out = runner.run([good[0], req(12, seed=5), good[1], req(12, seed=6)])
    assert [type(o) for o in out] == [np.ndarray, RuntimeError, np.ndarray, RuntimeError]
    assert "boom on 12 codes" in str(out[1])
    for got, want in zip((out[0], out[2]), expected, strict=True):
        assert np.abs(got - want).max() <= TOLERANCE


def test_a_request_with_nothing_to_voice_fails_alone(runner):
    out = runner.run([req(8, context=4, lookahead=4), req(8)])
    assert isinstance(out[0], ValueError) and "nothing to voice" in str(out[0])
    assert out[1].shape == (8 * SPC,)


@pytest.mark.parametrize("frames", [1, 2, 3, 7, 24, 97, 200])
def test_cpu_randn_of_mel_rows_is_prefix_stable(frames):
    """What the noise rule rests on: a shorter draw is the start of a longer one (80 values a frame)."""
    longer = torch.randn(1, 401, 80, generator=torch.Generator().manual_seed(9))
    assert torch.equal(torch.randn(1, frames, 80, generator=torch.Generator().manual_seed(9)),
                       longer[:, :frames])
    odd = torch.randn(1, 7, 3, generator=torch.Generator().manual_seed(9))  # 21 values: not a multiple of 16
    assert not torch.equal(odd, torch.randn(1, 9, 3, generator=torch.Generator().manual_seed(9))[:, :7])


def test_noise_is_the_rows_of_the_utterance_draw_transformers_makes(runner):
    t2w = runner.decoder
    torch.manual_seed(11)
    utterance = torch.randn([1, 100 * 2, t2w.mel_dim])[0]  # what sample() draws for 100 codes
    assert torch.equal(t2w.initial_noise(11, 0, 100), utterance)
    assert torch.equal(t2w.initial_noise(11, 61, 29), utterance[122:180])
    assert not torch.equal(t2w.initial_noise(12, 61, 29), utterance[122:180])
    assert torch.equal(t2w.initial_noise(-3, 0, 5), torch.randn(1, 10, 80, generator=torch.Generator()
                                                                .manual_seed(-3))[0])


def test_chunks_with_the_checkpoint_context_match_the_whole_decode(own_runner):
    (whole,) = own_runner.run([AudioRequest(codes=STREAM, context=0, voice="Chelsie", seed=4)])

    def streamed(ctx: ChunkContext) -> float:
        spans = chunk_plan(len(STREAM), 0, 24, ctx.left, final=True, right_context=ctx.right,
                           align=ctx.align)
        chunks = own_runner.run([AudioRequest(codes=STREAM[s.first:s.last], context=s.context,
                                              voice="Chelsie", seed=4, offset=s.first,
                                              lookahead=s.lookahead) for s in spans])
        out = np.concatenate(chunks)
        assert out.shape == whole.shape
        return 10 * np.log10((whole ** 2).sum() / ((whole - out) ** 2).sum())

    # measured (96 codes, chunks of 24, 10 steps): 95 dB one pass, 116 dB two, 52 dB DiT-only
    assert streamed(own_runner.context) > 80
    assert streamed(dit_context_codes(own_runner.decoder.model.config.dit_config)) < 70  # the vocoder matters


# --- Triton adapter (with a stand-in for triton_python_backend_utils) --------------------
class _Tensor:
    def __init__(self, name, arr):
        self.name, self.arr = name, arr

    def as_numpy(self):
        return self.arr


class _Metric:
    def __init__(self, labels, buckets=None):
        self.values: list[float] = []

    def observe(self, v):
        self.values.append(v)

    increment = observe


def _fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")

    class TritonError(Exception):
        INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

        def __init__(self, msg, code=None):
            super().__init__(msg)
            self.code = code

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):  # Triton's name
            return _Metric(labels, buckets)

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.outputs = {t.name: t.arr for t in output_tensors}
            self.error = error

    pb.TritonError, pb.MetricFamily, pb.InferenceResponse, pb.Tensor = (TritonError, MetricFamily,
                                                                        InferenceResponse, _Tensor)
    pb.get_input_tensor_by_name = lambda request, name: (
        None if request.get(name) is None else _Tensor(name, request[name]))
    return pb


def test_adapter_answers_each_request_and_adds_the_batch_dimension(tiny_omni_checkpoint, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    path = Path(__file__).resolve().parents[2] / "backends" / "omni_audio" / "model.py"
    spec = importlib.util.spec_from_file_location("omni_audio_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / ENGINE_ARGS_FILE).write_text(f'{{"model": "{tiny_omni_checkpoint}", "num_steps": {STEPS}}}')
    model = module.TritonPythonModel()
    model.initialize({"model_name": "audio", "model_repository": str(tmp_path)})

    good = tensors([STREAM[:10]], context_tokens=2, seed=1)  # [1, frames, 1] with the batch dimension
    out = model.execute([good, tensors([[[600]]]), tensors([STREAM[:10]], voice="Ethan", seed=1)])
    assert out[0].error is None and out[0].outputs[AUDIO.AUDIO_CHUNK].shape == (1, 8 * SPC)
    assert out[0].outputs[AUDIO.AUDIO_CHUNK].dtype == np.float32
    assert out[0].outputs[AUDIO.SAMPLE_RATE].tolist() == [[24000]]
    assert out[1].error.code == "INVALID_ARG"
    assert "codec_ids: codes must be in [0, 512)" in str(out[1].error)
    assert out[2].outputs[AUDIO.AUDIO_CHUNK].shape == (1, 10 * SPC)
    assert model._execute._batch.values == [3]
    assert model._seconds.values == [8 * SPC / 24000, 10 * SPC / 24000]


@pytest.mark.parametrize("kind, device_id, visible", [
    ("GPU", "3", "3"), ("CPU", "0", None), ("MODEL", "0", None),
])
def test_a_kind_gpu_instance_sees_only_the_gpu_triton_gave_it(tiny_omni_checkpoint, tmp_path, monkeypatch,
                                                                kind, device_id, visible):
    """Placement (issue 14): the adapter's initialize sets CUDA_VISIBLE_DEVICES before the
    runner (or vLLM's engine) starts, from Triton's instance kind and device id."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test, whatever it sets
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    path = Path(__file__).resolve().parents[2] / "backends" / "omni_audio" / "model.py"
    spec = importlib.util.spec_from_file_location("omni_audio_model_placed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = {}

    class Runner:
        sample_rate = 24000

        def __init__(self, cfg):
            seen["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")

    monkeypatch.setattr(module, "AudioRunner", Runner)
    (tmp_path / ENGINE_ARGS_FILE).write_text(f'{{"model": "{tiny_omni_checkpoint}"}}')
    module.TritonPythonModel().initialize({
        "model_name": "audio", "model_repository": str(tmp_path),
        "model_instance_kind": kind, "model_instance_device_id": device_id})
    assert seen["visible"] == visible
