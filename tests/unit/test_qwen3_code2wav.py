"""Qwen3-Omni's Code2Wav as the audio stage's codec decoder, golden against transformers.

Runs a tiny random-weight Code2Wav of the real architecture (16 code groups,
the real upsampling: 1920 samples a frame at 24 kHz; tiny widths, 2 layers,
a 12-frame sliding window) saved in the whole-checkpoint layout, on CPU,
through the audio stage's runner (omni_serve.audio.runner) and directly.
The weights are scaled so the waveform is loud (std ~0.2) and every tap
matters (layer scales and ConvNeXt gammas at 1), so a context one frame too
short shows.

Tolerances: 1e-4 against transformers (the brief's), 1e-5 between a batch and
its requests alone (oneDNN sums in another order for another batch size).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from omni_serve import families
from omni_serve.audio import runner as audio_runner
from omni_serve.audio.config import AudioStageConfig
from omni_serve.audio.request import AudioRequest, ChunkContext, chunk_plan, parse_request
from omni_serve.audio.runner import AudioRunner
from omni_serve.contract import AUDIO
from omni_serve.errors import RequestError
from omni_serve.families.qwen3_omni_moe.code2wav import Code2Wav
from omni_serve.families.qwen3_omni_moe.code2wav_context import chunk_context, receptive_field

torch.set_num_threads(1)

GOLDEN = 1e-4  # against transformers
BATCH = 1e-5  # batched vs alone
SPF = 1920  # samples per frame of the real rates
VOCAB = 64
TINY = {  # tiny widths, real groups and upsampling
    "codebook_size": VOCAB, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
    "intermediate_size": 64, "num_hidden_layers": 2, "sliding_window": 12, "decoder_dim": 32,
    "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
    "layer_scale_initial_scale": 1.0,
}
OUTPUT_GAIN = 0.5  # waveform rms ~0.2
RNG = np.random.default_rng(0)
STREAM = RNG.integers(0, VOCAB, (400, 16))  # [frames, groups]


def tiny_code2wav(seed: int = 0):
    """transformers' Code2Wav of TINY with loud random weights (float32, eval)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    torch.manual_seed(seed)
    model = Qwen3OmniMoeCode2Wav._from_config(Qwen3OmniMoeCode2WavConfig(**TINY),
                                              attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:  # unit gain; the residual units' convs half, so the ConvNet stays tame
                p.normal_(0, p[0].numel() ** -0.5 * (0.5 if ".conv1." in name or ".conv2." in name else 1))
        for blocks in model.upsample:
            blocks[1].gamma.fill_(1.0)
        model.decoder[-1].conv.weight.mul_(OUTPUT_GAIN)
    return model.eval()


def save_checkpoint(folder: Path, model, *, shards: bool = False) -> Path:
    """A whole-Qwen3-Omni folder: config.json with code2wav_config, the code2wav.* tensors
    (sharded with an index: a thinker shard of garbage that must never be opened)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
              "code2wav_config": dict(TINY)}
    (folder / "config.json").write_text(json.dumps(config))
    state = {f"code2wav.{k}": v.contiguous() for k, v in model.state_dict().items()}
    if not shards:
        save_file(state, str(folder / "model.safetensors"))
        return folder
    names = sorted(state)
    half = len(names) // 2
    weight_map = {"thinker.model.embed_tokens.weight": "model-00001-of-00003.safetensors"}
    (folder / "model-00001-of-00003.safetensors").write_bytes(b"not a safetensors file")
    for i, part in enumerate((names[:half], names[half:]), start=2):
        file = f"model-0000{i}-of-00003.safetensors"
        save_file({n: state[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def reference():
    return tiny_code2wav()


@pytest.fixture(scope="module")
def checkpoint(reference, tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("qwen3-omni") / "ckpt", reference)


@pytest.fixture(scope="module")
def runner(checkpoint):
    """The audio stage's runner on the checkpoint; the family's decoder is loaded by hand
    until the qwen3_omni_moe family is registered."""
    cfg = AudioStageConfig(model=str(checkpoint))
    try:
        families.for_checkpoint(str(checkpoint))
    except ValueError:  # no family serves model_type qwen3_omni_moe yet
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(audio_runner, "load_decoder", Code2Wav.load)
            yield AudioRunner(cfg)
    else:
        yield AudioRunner(cfg)


def forward(model, codes: np.ndarray) -> np.ndarray:
    """transformers' forward of [frames, groups] codes: float32 samples."""
    with torch.no_grad():
        return model(torch.from_numpy(codes.T[None].copy()))[0, 0].numpy()


def request(begin: int, end: int, context: int = 0) -> AudioRequest:
    return AudioRequest(codes=STREAM[begin - context:end], context=context, voice=None, seed=0,
                        offset=begin - context)


def orchestrator_stream(runner, total: int, first: int, steady: int, left: int) -> np.ndarray:
    """The chunks the orchestrator sends for `total` frames (orchestrator/speech.py `_plan`:
    the first chunk `first` frames, then `steady`), voiced one call each and concatenated."""
    pieces, done = [], 0
    while done < total:
        span = chunk_plan(total, done, first if done == 0 else steady, left, True)[0]
        pieces.append(runner.run([request(span.begin, span.end, span.context)])[0])
        done = span.end
    return np.concatenate(pieces)


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    err = float(np.sum((ref - got) ** 2))
    return math.inf if err == 0 else 10 * math.log10(float(np.sum(ref ** 2)) / err)


# --- context ------------------------------------------------------------------------
def test_the_real_models_field_is_its_windows_and_convs_and_transformers_keeps_less():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    real = receptive_field(Qwen3OmniMoeCode2WavConfig())  # Qwen3-Omni-30B-A3B's code2wav_config
    assert (real.attention, real.delay) == (8 * (72 - 1), 8 * 5 * 4 * 3 + 5 * 4 * 3 + 4 * 3 + 3)
    assert chunk_context({"code2wav_config": Qwen3OmniMoeCode2WavConfig().to_dict()}) == \
        ChunkContext(real.left, 0, 1)
    assert real.left > 25  # transformers' chunked_decode left context is an approximation
    assert chunk_context({"model_type": "qwen2_5_omni", "token2wav_config": {}}) is None


def test_the_delay_is_what_a_forward_falls_short_of(reference):
    field = receptive_field(reference.config)
    for n in (1, 7):
        assert len(forward(reference, STREAM[:n])) == n * SPF - field.delay


def test_a_chunk_reads_exactly_its_left_context(reference):
    """Changing the frame `left` frames before a chunk's first voiced frame changes its audio;
    changing the one before that does not (the field is tight)."""
    field = receptive_field(reference.config)
    begin = field.left + 8
    codes = STREAM[:begin + 4]
    start = begin * SPF - field.delay  # the first sample the chunk voices
    whole = forward(reference, codes)[start:]
    changes = []
    for back in (field.left, field.left + 1):
        bumped = codes.copy()
        bumped[begin - back] = (bumped[begin - back] + 1) % VOCAB
        changes.append(np.abs(forward(reference, bumped)[start:] - whole).max())
    assert changes[0] > 0 and changes[1] == 0, changes  # an unread frame leaves every bit as it was


def test_the_convnet_reads_exactly_its_field(runner):
    """The transformer's output `conv` frames before the chunk reaches its audio, one more does not."""
    decoder = runner.decoder
    conv, delay = decoder.field.conv, decoder.field.delay
    hidden = torch.randn(1, conv + 12, TINY["hidden_size"])
    start = (conv + 2) * SPF - delay
    with torch.no_grad():
        whole = decoder.convnet(hidden)[0, 0, start:]
        changes = []
        for back in (conv, conv + 1):
            bumped = hidden.clone()
            bumped[0, 2 - back + conv] += 1
            changes.append((decoder.convnet(bumped)[0, 0, start:] - whole).abs().max().item())
    assert changes[0] > 0 and changes[1] == 0, changes  # an unread frame leaves every bit as it was


# --- loading ------------------------------------------------------------------------
def test_the_decoder_reads_limits_from_the_checkpoint(runner, reference):
    decoder = runner.decoder
    assert (decoder.sample_rate, decoder.samples_per_frame, decoder.codec_groups) == (24_000, SPF, 16)
    assert decoder.codec_vocab == VOCAB and decoder.voices == () and decoder.default_voice is None
    assert runner.context == chunk_context({"code2wav_config": TINY}) == \
        ChunkContext(receptive_field(reference.config).left, 0, 1)
    assert runner.limits.codec_groups == 16 and runner.limits.max_utterance_codes is None


def test_sharded_weights_are_read_from_their_shards_only(reference, tmp_path):
    folder = save_checkpoint(tmp_path / "sharded", reference, shards=True)
    decoder = Code2Wav.load(AudioStageConfig(model=str(folder)))
    got = decoder.decode([request(0, 9)])[0, decoder.field.delay:]
    np.testing.assert_allclose(got, forward(reference, STREAM[:9]), atol=GOLDEN, rtol=0)


@pytest.mark.parametrize("setting", [{"num_steps": 4}, {"guidance_scale": 0.5}, {"sway_coefficient": -1.0}])
def test_sampler_settings_are_an_error(checkpoint, setting):
    with pytest.raises(ValueError, match=f"{next(iter(setting))}=.*does not sample"):
        Code2Wav.load(AudioStageConfig(model=str(checkpoint), **setting))


def test_a_folder_without_code2wav_names_what_to_give(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    with pytest.raises(ValueError, match="no code2wav_config"):
        Code2Wav.load(AudioStageConfig(model=str(tmp_path)))


def test_weights_that_do_not_fit_the_config_are_named(reference, tmp_path):
    folder = save_checkpoint(tmp_path / "ckpt", reference)
    config = json.loads((folder / "config.json").read_text())
    config["code2wav_config"]["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"1\d missing \(code2wav.pre_transformer.layers.2"):
        Code2Wav.load(AudioStageConfig(model=str(folder)))


# --- goldens --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 40])
def test_a_whole_utterance_is_transformers_forward_from_its_first_sample(runner, reference, n):
    """One request of every frame: the decoder's `delay` samples of silence, which the stage drops
    from an utterance's first chunk, then transformers' forward (which is also its
    chunked_decode(300, 25) for utterances up to 300 frames), sample for sample."""
    decoded = runner.decoder.decode([request(0, n)])[0]
    out = runner.run([request(0, n)])[0]
    delay = runner.decoder.lead_samples
    assert delay == runner.decoder.field.delay and not decoded[:delay].any()
    with torch.no_grad():
        chunked = reference.chunked_decode(torch.from_numpy(STREAM[:n].T[None].copy()), 300, 25)[0, 0]
    assert len(out) == n * SPF - delay
    np.testing.assert_allclose(out, forward(reference, STREAM[:n]), atol=GOLDEN, rtol=0)
    np.testing.assert_allclose(out, chunked.numpy(), atol=GOLDEN, rtol=0)


def test_transformers_chunking_through_the_stage_is_its_chunked_decode_plus_what_it_drops(runner, reference):
    """Chunks of 300 with 25 frames of left context, as chunked_decode cuts them: each chunk's
    audio from the stage is transformers' chunk after `delay` samples, which it drops."""
    total, delay = 330, runner.decoder.field.delay
    spans = chunk_plan(total, 0, 300, 25, True)
    pieces = runner.run([request(s.begin, s.end, s.context) for s in spans])
    with torch.no_grad():
        chunked = reference.chunked_decode(torch.from_numpy(STREAM[:total].T[None].copy()), 300, 25)
    # the first chunk comes without the utterance's leading silence
    assert [len(p) for p in pieces] == [(s.end - s.begin) * SPF - (delay if s.begin == 0 else 0)
                                        for s in spans]
    np.testing.assert_allclose(np.concatenate([pieces[0]] + [p[delay:] for p in pieces[1:]]),
                               chunked[0, 0].numpy(), atol=GOLDEN, rtol=0)


def test_a_stream_with_the_checkpoint_context_is_the_whole_decode(runner):
    """The orchestrator's chunks (first 6 frames, then 12) with `context.left` frames of left
    context, concatenated, are the whole utterance's decode. Measured on the tiny model (80
    frames): max abs 5.5e-6, SNR 118.8 dB, the float32 floor (transformers' forward in float32
    against float64: 4.0e-6, 119.1 dB); transformers' 25 frames (less than this model's field of
    32): 0.21 max abs, 33 dB."""
    total = 80
    whole = runner.run([request(0, total)])[0]
    exact = orchestrator_stream(runner, total, 6, 12, runner.context.left)
    assert len(exact) == len(whole)
    assert np.abs(exact - whole).max() < 3e-5 and snr_db(whole, exact) > 110
    short = orchestrator_stream(runner, total, 6, 12, 25)
    assert snr_db(whole, short) < 60  # the field is not a formality on this model


def test_a_batch_of_equal_length_chunks_is_each_chunk_alone(runner):
    decoder = runner.decoder
    group = [request(30, 42, 30), request(50, 60, 32), request(100, 113, 29)]
    assert len({len(r.codes) for r in group}) == 1
    assert len({runner.group_key(r) for r in group}) == 1
    batched = decoder.decode(group)
    alone = np.concatenate([decoder.decode([r]) for r in group])
    for r, b, a in zip(group, batched, alone, strict=True):
        voiced = slice(r.context * SPF, None)  # what the stage keeps, and the delay before it
        np.testing.assert_allclose(b[voiced], a[voiced], atol=BATCH, rtol=0)
    outs = runner.run(group)
    for r, out in zip(group, outs, strict=True):
        np.testing.assert_allclose(out, runner.run([r])[0], atol=BATCH, rtol=0)


def test_the_voiced_audio_of_a_long_context_chunk_is_computed_in_full(runner, reference):
    """The ConvNet skips context frames the voiced audio does not read; what the stage keeps is
    still transformers' forward over the frames sent."""
    r = request(60, 70, 60)
    out = runner.decoder.decode([r])[0]
    voiced, delay = r.context * SPF, runner.decoder.field.delay
    np.testing.assert_allclose(out[voiced:], forward(reference, r.codes)[voiced - delay:], atol=GOLDEN,
                               rtol=0)


# --- requests the stage refuses -------------------------------------------------------
@pytest.mark.parametrize("codes, message", [
    (STREAM[:5, :8], r"expected shape \[frames, 16\]"),
    (np.full((5, 16), VOCAB), rf"codes must be in \[0, {VOCAB}\), got {VOCAB} at frame 0, group 0"),
    (np.full((5, 16), -1), r"codes must be in \[0, 64\)"),
])
def test_bad_codes_are_a_request_error(runner, codes, message):
    with pytest.raises(RequestError, match=message) as e:
        parse_request({AUDIO.CODEC_IDS: codes}, runner.limits)
    assert e.value.field == AUDIO.CODEC_IDS


def test_a_voice_is_a_request_error_and_a_default_voice_a_config_error(runner, checkpoint):
    with pytest.raises(RequestError, match="no voices"):
        parse_request({AUDIO.CODEC_IDS: STREAM[:3], AUDIO.VOICE: np.array([b"Ethan"], dtype=object)},
                      runner.limits)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(audio_runner, "load_decoder", Code2Wav.load)
        with pytest.raises(ValueError, match="has no voices"):
            AudioRunner(AudioStageConfig(model=str(checkpoint), default_voice="Ethan"))


def test_codes_that_reach_the_decoder_unchecked_fail_alone(runner):
    bad = AudioRequest(codes=np.full((5, 16), VOCAB), context=0, voice=None, seed=0)
    good = request(0, 5)
    out = runner.run([bad, good])
    assert isinstance(out[0], ValueError) and "codes must be in [0, 64)" in str(out[0])
    np.testing.assert_allclose(out[1], runner.run([good])[0], atol=BATCH, rtol=0)
