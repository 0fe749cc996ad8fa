"""Qwen3-Omni's talker on vLLM draws the codes transformers draws (tiny random checkpoint, CPU).

Where it runs: the pytest process; the engine test runs vLLM in-process (no engine-core
subprocess), so the talker class is registered here rather than by the plugin.
What flows through it: transformers' `Qwen3OmniMoeForConditionalGeneration.generate(
return_audio=True)` with greedy thinker and talker, spied on to keep the talker's inputs
(prompt embeddings, trailing text rows) and its frames; the same prompt embeddings and the
reply's token ids go to the served talker, whose code 0 per step and residual codes (the
side-channel file) must make the same [frames, 16].
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_serve.families.qwen3_omni_moe import talker_engine, talker_prompt
from omni_serve.families.qwen3_omni_moe.talker_model import CodePredictor, ResizeMLP, filter_logits
from omni_tools.tiny_qwen3_omni import QWEN3_OMNI_CHAT_TEMPLATE, build_qwen3_omni_checkpoint

GROUPS = 16
TALKER_FRAMES = 12  # talker_max_new_tokens: frames 0..10 get their residual codes
THINKER_TOKENS = 8
PROMPTS = ("hello there how are you", "say something short about the sea")
MORE_PROMPTS = ("tell me a story", "what is the time now")
KV_BYTES = 4 * 32 * 1024  # 4 blocks of 32 positions of the tiny talker (1 KiB a position)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3") / "omni"
    build_qwen3_omni_checkpoint(out)
    return out


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(checkpoint))


def _inputs(processor, text: str, image=None, audio=None) -> dict:
    parts = [{"type": "text", "text": text}]
    if image is not None:
        parts.insert(0, {"type": "image", "image": image})
    if audio is not None:
        parts.insert(0, {"type": "audio", "audio": audio})
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}],
                                           chat_template=QWEN3_OMNI_CHAT_TEMPLATE,
                                           add_generation_prompt=True, tokenize=False)
    return dict(processor(text=prompt, images=None if image is None else [image],
                          audio=None if audio is None else [audio], return_tensors="pt"))


def _generate(model, inputs: dict) -> dict:
    """transformers' greedy run of one user turn: what its talker got and drew."""
    seen: dict = {}
    talker_generate, thinker_generate = model.talker.generate, model.thinker.generate

    def spy(**kwargs):
        seen.update(kwargs, result=talker_generate(**kwargs))
        return seen["result"]

    def thinker_spy(*args, **kwargs):
        seen["thinker"] = thinker_generate(*args, **kwargs)
        return seen["thinker"]

    model.talker.generate, model.thinker.generate = spy, thinker_spy
    try:
        sequences, _ = model.generate(**inputs, return_audio=True, thinker_do_sample=False,
                                      talker_do_sample=False, speaker="ethan",
                                      thinker_max_new_tokens=THINKER_TOKENS,
                                      talker_max_new_tokens=TALKER_FRAMES,
                                      thinker_eos_token_id=model.config.im_end_token_id)
    finally:
        model.talker.generate, model.thinker.generate = talker_generate, thinker_generate
    result = seen["result"]
    frames = torch.stack([h[-1] for h in result.hidden_states if h[-1] is not None], dim=1)[0]
    ids = inputs["input_ids"]
    accept = model.config.talker_config.accept_hidden_layer
    mask = inputs.get("feature_attention_mask")
    return {"prompt": ids[0].tolist(), "reply": sequences[0, ids.shape[1]:].tolist(),
            "prompt_embeds": seen["inputs_embeds"][0], "trailing": seen["trailing_text_hidden"][0],
            "pad": seen["tts_pad_embed"][0, 0], "frames": frames.numpy(),
            "thinker_hidden": seen["thinker"].hidden_states[0][accept][0].numpy(),
            "media": {"image_grid_thw": inputs.get("image_grid_thw"),
                      "audio_feature_lengths": None if mask is None else mask.sum(1)}}


@pytest.fixture(scope="module")
def references(model, processor) -> list[dict]:
    return [_generate(model, _inputs(processor, text)) for text in PROMPTS]


@pytest.fixture(scope="module")
def media_references(model, processor) -> list[dict]:
    from PIL import Image

    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(64, 64, 3) * 255).astype(np.uint8))
    audio = (rng.randn(16000) * 0.1).astype(np.float32)
    return [_generate(model, _inputs(processor, "what is in it", image=image)),
            _generate(model, _inputs(processor, "what do you hear", audio=audio))]


# --- the model's parts against transformers' modules --------------------------------------

def _predictor_and_frames(talker, rows: int, seed: int):
    """Our code predictor with transformers' weights, and `rows` frames' inputs: a talker
    hidden state and code 0's embedding each."""
    predictor = CodePredictor(talker.config.code_predictor_config)
    predictor.load_state_dict(talker.code_predictor.state_dict())
    g = torch.Generator().manual_seed(seed)
    past = torch.randn(rows, talker.config.text_config.hidden_size, generator=g)
    code0 = torch.randint(0, talker.config.code_predictor_config.vocab_size, (rows,), generator=g)
    return predictor, past, talker.get_input_embeddings()(code0)


def test_the_code_predictor_draws_a_batch_of_frames_as_transformers_draws_each_one(model):
    talker = model.talker
    predictor, past, first = _predictor_and_frames(talker, 6, seed=3)
    with torch.no_grad():
        drawn = predictor.draw(past, first)
        sums = predictor.frame_embedding(first, drawn)
    for b in range(6):
        ref = talker.code_predictor.generate(
            inputs_embeds=torch.stack([past[b], first[b]])[None], max_new_tokens=GROUPS - 1,
            do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
        assert drawn[b].tolist() == ref.sequences[0].tolist()
        # transformers' next talker input: code 0's embedding, the fed-back residual
        # embeddings, the last code's embedding, summed as one reduction (to the bit)
        fed = [h[0][0, 0] for h in ref.hidden_states[1:]]
        last = talker.code_predictor.get_input_embeddings()[-1](ref.sequences[0, -1:])[0]
        assert torch.equal(sums[b], torch.stack([first[b], *fed, last])[None].sum(1)[0])


def test_every_code_predictor_step_has_transformers_logits_to_the_bit(model):
    # The predictor is written for few ops per step (fused norms, q and k rotated as one
    # tensor); in float32 every step's logits must still be transformers' for the same
    # batch exactly, so a near tie between two codes falls the same way.
    talker = model.talker
    predictor, past, first = _predictor_and_frames(talker, 3, seed=5)
    ours: list[torch.Tensor] = []
    drawn = predictor.draw(past, first, logits=ours)
    ref = talker.code_predictor.generate(
        inputs_embeds=torch.stack([past, first], dim=1), max_new_tokens=GROUPS - 1,
        do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert drawn.tolist() == ref.sequences.tolist()
    for k in range(GROUPS - 1):
        assert torch.equal(ours[k], ref.logits[k]), f"code {k + 1}"


def test_residual_sampling_filters_logits_as_transformers_warpers_do():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 128, generator=g) * 3
    settings = [(1.0, 50, 0.8), (0.7, 5, 1.0), (1.3, 0, 0.5), (1.0, 128, 0.95)]
    mine = filter_logits(logits, torch.tensor([t for t, _, _ in settings]),
                         torch.tensor([k for _, k, _ in settings]),
                         torch.tensor([p for _, _, p in settings]))
    for row, (t, k, p) in zip(range(4), settings, strict=True):
        ref = TemperatureLogitsWarper(t)(None, logits[row:row + 1].clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(torch.isinf(mine[row]), torch.isinf(ref[0]))
        torch.testing.assert_close(mine[row][~torch.isinf(mine[row])], ref[0][~torch.isinf(ref[0])])


def test_a_seeded_request_draws_the_same_residual_codes_alone_and_in_a_batch(model):
    from types import SimpleNamespace

    talker = model.talker
    predictor = CodePredictor(talker.config.code_predictor_config)
    predictor.load_state_dict(talker.code_predictor.state_dict())
    engine_model = SimpleNamespace(code_predictor=predictor)
    settings = {**talker_engine.RESIDUAL_SAMPLING, "seed": 7}
    g = torch.Generator().manual_seed(9)
    past = torch.randn(3, talker.config.text_config.hidden_size, generator=g)
    first = talker.get_input_embeddings()(torch.tensor([3, 50, 90]))

    def draw(rows, requests):
        sampling = talker_engine.residual_sampling(requests, engine_model, "cpu")
        return predictor.draw(past[rows], first[rows], sampling)

    alone = [draw([0], [(talker_engine._Request(), settings)]) for _ in range(2)]
    batch = draw([1, 0, 2], [(talker_engine._Request(), {**settings, "seed": 8}),
                             (talker_engine._Request(), settings), (talker_engine._Request(), None)])
    assert torch.equal(alone[0], alone[1]) and torch.equal(batch[1], alone[0][0])
    assert torch.equal(batch[2], predictor.draw(past[2:], first[2:]).squeeze(0))
    # sampled, not greedy: seed 7 draws other codes than the argmax
    assert not torch.equal(alone[0], predictor.draw(past[:1], first[:1]))


def test_a_sampled_request_draws_its_residual_codes_as_transformers_code_predictor_samples():
    from vllm import SamplingParams

    sampled = talker_engine.residual_settings({}, SamplingParams(temperature=0.9, seed=4))
    assert sampled == {"temperature": 1.0, "top_k": 50, "top_p": 0.8, "seed": 4}
    assert talker_engine.residual_settings({}, SamplingParams(temperature=0.0)) is None


@pytest.fixture(scope="module")
def prompter(checkpoint):
    return talker_prompt.TalkerPrompter(checkpoint)


def test_the_talker_prompt_is_transformers_talker_prompt(prompter, references):
    for ref in references:
        embeds = prompter.prompt_embeds(ref["prompt"], ref["reply"], "ethan")
        torch.testing.assert_close(embeds, ref["prompt_embeds"], rtol=1e-5, atol=1e-5)


def test_a_media_prompt_is_transformers_talker_prompt(prompter, media_references):
    for ref in media_references:
        embeds = prompter.prompt_embeds(ref["prompt"], ref["reply"], "ethan", ref["thinker_hidden"])
        torch.testing.assert_close(embeds, ref["prompt_embeds"], rtol=1e-5, atol=1e-5)


def test_the_decode_steps_text_ids_give_transformers_trailing_text_rows(model, references):
    projection = ResizeMLP(model.talker.config)
    projection.load_state_dict(model.talker.text_projection.state_dict())
    embed = model.thinker.get_input_embeddings()
    for ref in references:
        ids = talker_prompt.trailing_text_ids(ref["prompt"], ref["reply"], model.config)
        with torch.no_grad():
            rows = projection(embed(torch.tensor(ids)))
            pad = projection(embed(torch.tensor([model.config.tts_pad_token_id])))[0]
        torch.testing.assert_close(rows, ref["trailing"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pad, ref["pad"], rtol=1e-5, atol=1e-5)


# --- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(checkpoint):
    from vllm import LLM, ModelRegistry

    # the registration below reaches the worker in-process; and vLLM's CPU platform lets a
    # VLLM_CPU_KVCACHE_SPACE in the environment (tests/integration/conftest.py sets one)
    # override kv_cache_memory_bytes, which would leave the batch room enough never to be
    # preempted
    saved = {key: os.environ.pop(key, None)
             for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ModelRegistry.register_model(talker_prompt.ARCHITECTURE, talker_prompt.MODEL_CLASS)
    args = talker_prompt.engine_args({"model": str(checkpoint)})
    try:
        # 4 blocks of 32 positions: a batch that outgrows them has requests preempted and
        # recomputed
        llm = LLM(**args, enforce_eager=True, dtype="float32", max_model_len=64, max_num_seqs=4,
                  block_size=32, kv_cache_memory_bytes=KV_BYTES)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    assert llm.collective_rpc(talker_engine.RPC) == [""]
    yield llm
    del llm


def test_the_served_talker_draws_transformers_frames_for_a_batch_of_requests(
        engine, prompter, references):
    import tempfile

    from vllm import SamplingParams

    directory = tempfile.mkdtemp(prefix="omni_hs_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    prompts, params, files = [], [], []
    for i, ref in enumerate(references):
        path = os.path.join(directory, f"codes{i}")
        open(path, "wb").close()
        files.append(path)
        prompt, extra = prompter.build(ref["prompt"], ref["reply"], "ethan", codes_file=path)
        prompts.append(prompt)
        params.append(SamplingParams(**prompter.sampling({"temperature": 0.0, "max_tokens": TALKER_FRAMES}),
                                     extra_args=extra, detokenize=False))
    try:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        for ref, out, path in zip(references, outputs, files, strict=True):
            frames = talker_prompt.FrameStream(path, GROUPS).push(list(out.outputs[0].token_ids))
            assert frames.shape == ref["frames"].shape
            np.testing.assert_array_equal(frames, ref["frames"])
    finally:
        for path in files:
            os.unlink(path)
        os.rmdir(directory)


def test_preempted_requests_redraw_nothing_and_give_transformers_frames(
        engine, model, processor, prompter, references):
    import tempfile

    from vllm import SamplingParams

    refs = references + [_generate(model, _inputs(processor, text)) for text in MORE_PROMPTS]
    before = engine.collective_rpc(talker_engine.STATS_RPC)[0]
    directory = tempfile.mkdtemp(prefix="omni_hs_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    prompts, params, streams = [], [], []
    for i, ref in enumerate(refs):
        path = os.path.join(directory, f"codes{i}")
        open(path, "wb").close()
        prompt, extra = prompter.build(ref["prompt"], ref["reply"], "ethan", codes_file=path)
        streams.append(talker_prompt.FrameStream(path, GROUPS))
        prompts.append(prompt)
        params.append(SamplingParams(**prompter.sampling({"temperature": 0.0, "max_tokens": TALKER_FRAMES}),
                                     extra_args=extra, detokenize=False))
    try:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        after = engine.collective_rpc(talker_engine.STATS_RPC)[0]
        assert after["recomputed_frames"] > before["recomputed_frames"]  # some were preempted
        for ref, out, stream in zip(refs, outputs, streams, strict=True):
            np.testing.assert_array_equal(stream.push(list(out.outputs[0].token_ids)), ref["frames"])
    finally:
        for stream in streams:
            stream.close()
        os.rmdir(directory)


def _handed_over(directory: str, name: str, model, ref: dict) -> str:
    """The thinker's capture file as a thinker stage hands it over, complete: rows
    [input embedding | hidden after accept_hidden_layer] of the prompt and the fed reply."""
    ids = torch.tensor(ref["prompt"] + ref["reply"][:-1])
    with torch.no_grad():
        embeds = model.thinker.get_input_embeddings()(ids).numpy()
    hidden = np.zeros_like(embeds)
    hidden[:len(ref["prompt"])] = ref["thinker_hidden"]  # the talker reads the prompt's only
    path = os.path.join(directory, name)
    np.concatenate([embeds, hidden], axis=1).astype(np.float32).tofile(path)
    return path


def test_the_served_talker_draws_transformers_frames_for_image_and_audio_prompts(
        engine, model, prompter, media_references):
    import asyncio
    import tempfile

    from vllm import SamplingParams

    from omni_serve.llm import hidden_states
    from omni_serve.talker.request import TalkerInput

    directory = tempfile.mkdtemp(prefix="omni_hs_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    prompts, params, streams, sources = [], [], [], []
    try:
        for i, ref in enumerate(media_references):
            source = _handed_over(directory, f"thinker{i}", model, ref)
            sources.append(source)
            hidden_states.write_final_rows(source, len(ref["prompt"]) + len(ref["reply"]) - 1)
            media = ref["media"]
            req = TalkerInput(source=source, prompt_token_ids=tuple(ref["prompt"]), voice="Ethan",
                              image_grid_thw=None if media["image_grid_thw"] is None
                              else media["image_grid_thw"].numpy(),
                              audio_feature_lengths=None if media["audio_feature_lengths"] is None
                              else media["audio_feature_lengths"].numpy())
            prompt, extra = asyncio.run(prompter.prompt(req, timeout_s=5.0))
            torch.testing.assert_close(prompt["prompt_embeds"], ref["prompt_embeds"], rtol=1e-5, atol=1e-5)
            streams.append(prompter.frame_stream(extra))
            prompts.append(prompt)
            params.append(SamplingParams(**prompter.sampling({"temperature": 0.0,
                                                              "max_tokens": TALKER_FRAMES}),
                                         extra_args=extra, detokenize=False))
        # the image's 2 x 2 merged patches take 2 positions: decode positions run 2 behind
        assert params[0].extra_args[talker_engine.EXTRA_ARG]["delta"] == -2
        outputs = engine.generate(prompts, params, use_tqdm=False)
        for ref, out, stream in zip(media_references, outputs, streams, strict=True):
            np.testing.assert_array_equal(stream.push(list(out.outputs[0].token_ids)), ref["frames"])
    finally:
        for stream in streams:
            stream.close()
        for source in sources:
            hidden_states.remove_handed_over(source)
        os.rmdir(directory)


def test_a_talker_request_waits_for_the_thinkers_rows_and_then_draws_transformers_frames(
        engine, model, prompter, references):
    import tempfile

    from vllm import SamplingParams

    from omni_serve.llm import hidden_states

    ref = references[0]
    thinker_ids = torch.tensor(ref["prompt"] + ref["reply"][:-1])
    with torch.no_grad():
        embeds = model.thinker.get_input_embeddings()(thinker_ids).numpy()
    rows = np.concatenate([embeds, np.zeros_like(embeds)], axis=1).astype(np.float32)
    first_row = talker_prompt.assistant_start(ref["prompt"], model.config) + 4
    ready = first_row + 4  # the text of frames 0..3 is there, frame 4's not yet
    directory = tempfile.mkdtemp(prefix="omni_hs_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    thinker_file, codes_file = os.path.join(directory, "thinker"), os.path.join(directory, "codes")
    rows[:ready].tofile(thinker_file)
    open(codes_file, "wb").close()
    prompt, extra = prompter.build(ref["prompt"], ref["reply"][:2], "ethan", codes_file=codes_file,
                                   thinker_file=thinker_file)
    stream = talker_prompt.FrameStream(codes_file, GROUPS)
    params = SamplingParams(**prompter.sampling({"temperature": 0.0, "max_tokens": TALKER_FRAMES}),
                            extra_args=extra, detokenize=False)
    core = engine.llm_engine
    try:
        core.add_request("streamed", prompt, params)
        code0: list[int] = []
        for _ in range(12):  # prefill + frames 0..3; then it waits, however long we step
            for out in core.step():
                code0 = list(out.outputs[0].token_ids)
        assert len(code0) == 5
        early = stream.push(code0)  # frames 0..3, complete before the thinker goes on
        np.testing.assert_array_equal(early, ref["frames"][:4])
        with open(thinker_file, "ab") as f:
            rows[ready:].tofile(f)
        hidden_states.write_final_rows(thinker_file, len(rows))
        finished = False
        while not finished:
            for out in core.step():
                code0, finished = list(out.outputs[0].token_ids), out.finished
        np.testing.assert_array_equal(np.concatenate([early, stream.push(code0[5:])]), ref["frames"])
    finally:
        hidden_states.remove_handed_over(thinker_file)
        stream.close()
        os.rmdir(directory)
