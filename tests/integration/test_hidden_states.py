"""Hidden states out of the LLM core, through a real tritonserver, against transformers.

`llm` with `return_hidden_states` streams, with its tokens, each position's input
embedding and final hidden state: what transformers' `generate(output_hidden_states=True)`
gives as `hidden_states[step][0]` and `[-1]` (prompt positions at step 0, then each
generated token as it is fed back). Reference: the same checkpoint folder, fp32, greedy.
"""
from __future__ import annotations

import io
import json
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from omni_serve.contract import LLM
from omni_serve.llm.hidden_states import read_rows, split_rows
from omni_tools.tiny_models import ensure_model

from .llm_io import metric
from .omni_io import png, tone

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
# final hidden states: vLLM's CPU kernels sum in another order than transformers', and the
# difference grows with the value (AMD EPYC: 1.01e-4 at a value of 1.05 in one decode row)
RTOL = 1e-4
MAX_TOKENS = 8


@dataclass
class Served:
    token_ids: list[int] = field(default_factory=list)
    embeds: list[np.ndarray] = field(default_factory=list)
    hidden: list[np.ndarray] = field(default_factory=list)
    rows_per_response: list[int] = field(default_factory=list)
    tokens_per_response: list[int] = field(default_factory=list)
    files: set[str] = field(default_factory=set)  # hidden_states_in_shm: the handed-over file
    error: Exception | None = None

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.embeds), np.concatenate(self.hidden)


def _tensor(name: str, arr: np.ndarray, dtype: str) -> grpcclient.InferInput:
    x = grpcclient.InferInput(name, list(arr.shape), dtype)
    x.set_data_from_numpy(arr)
    return x


def serve(url: str, *, prompt: str | None = None, prompt_ids: list[int] | None = None,
          image_embeds: np.ndarray | None = None, grid_thw: np.ndarray | None = None,
          audio_features: np.ndarray | None = None, audio_lengths: np.ndarray | None = None,
          stream: bool = True, max_tokens: int = MAX_TOKENS, sampling: dict | None = None,
          in_shm: bool = False) -> Served:
    ins = [_tensor(LLM.STREAM, np.array([stream]), "BOOL"),
           _tensor(LLM.HIDDEN_STATES_IN_SHM, np.array([in_shm]), "BOOL"),
           _tensor(LLM.RETURN_HIDDEN_STATES, np.array([True]), "BOOL"),
           _tensor(LLM.RETURN_TOKEN_IDS, np.array([True]), "BOOL"),
           _tensor(LLM.SAMPLING_PARAMETERS, np.array([json.dumps(
               sampling or {"temperature": 0, "max_tokens": max_tokens}).encode()], object),
               "BYTES")]
    if prompt is not None:
        ins.append(_tensor(LLM.TEXT_INPUT, np.array([prompt.encode()], object), "BYTES"))
    if prompt_ids is not None:
        ins.append(_tensor(LLM.PROMPT_TOKEN_IDS, np.array(prompt_ids, np.int64), "INT64"))
    if image_embeds is not None:
        ins.append(_tensor(LLM.IMAGE_EMBEDS, image_embeds.astype(np.float32), "FP32"))
        ins.append(_tensor(LLM.IMAGE_GRID_THW, grid_thw.astype(np.int64), "INT64"))
    if audio_features is not None:
        ins.append(_tensor(LLM.AUDIO_FEATURES, audio_features.astype(np.float32), "FP32"))
        ins.append(_tensor(LLM.AUDIO_FEATURE_LENGTHS, audio_lengths.astype(np.int64), "INT64"))
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    served = Served()
    try:
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        client.async_stream_infer("llm", ins, enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=120)
            if error is not None:
                served.error = error
                return served
            response = result.get_response()
            if result.as_numpy(LLM.TOKEN_IDS) is not None:
                served.token_ids += result.as_numpy(LLM.TOKEN_IDS).tolist()
                served.tokens_per_response.append(len(result.as_numpy(LLM.TOKEN_IDS)))
                if in_shm:  # what a caller on this host does: read the rows from the file
                    assert result.as_numpy(LLM.HIDDEN_STATES) is None
                    path = result.as_numpy(LLM.HIDDEN_STATES_FILE)[0].decode()
                    first, count, width = result.as_numpy(LLM.HIDDEN_STATES_ROWS).tolist()
                    assert first == sum(served.rows_per_response)
                    embeds, hidden = split_rows(read_rows(path, first, count, width))
                    served.files.add(path)
                else:
                    embeds = result.as_numpy(LLM.INPUT_EMBEDS)
                    hidden = result.as_numpy(LLM.HIDDEN_STATES)
                assert embeds.shape == hidden.shape
                served.embeds.append(embeds)
                served.hidden.append(hidden)
                served.rows_per_response.append(len(hidden))
            if response.parameters["triton_final_response"].bool_param:
                return served
    finally:
        client.stop_stream()
        client.close()


@dataclass
class Reference:
    token_ids: list[int]
    embeds: np.ndarray  # (prompt + n - 1, hidden)
    hidden: np.ndarray


def reference_generate(model, max_tokens: int = MAX_TOKENS, **inputs) -> Reference:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                             output_hidden_states=True, return_dict_in_generate=True)
    prompt_len = inputs["input_ids"].shape[1]
    return Reference(out.sequences[0, prompt_len:].tolist(),
                     torch.cat([step[0][0] for step in out.hidden_states]).numpy(),
                     torch.cat([step[-1][0] for step in out.hidden_states]).numpy())


def assert_equal_to(served: Served, ref: Reference) -> None:
    assert served.error is None, served.error
    assert served.token_ids == ref.token_ids
    embeds, hidden = served.rows()
    assert embeds.shape == ref.embeds.shape  # prompt + n - 1 rows, nothing more or less
    assert np.abs(embeds - ref.embeds).max() <= TOLERANCE
    np.testing.assert_allclose(hidden, ref.hidden, rtol=RTOL, atol=TOLERANCE)


# --- Qwen2.5-Omni's thinker (omni-chat's llm) -------------------------------------------------

@pytest.fixture(scope="module")
def omni(omni_chat_server):
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

    torch.set_num_threads(1)
    path = json.loads((Path(omni_chat_server.repository) / "llm" / "engine.json").read_text())["model"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return {"url": omni_chat_server.grpc_url, "thinker": model.thinker,
            "processor": Qwen2_5OmniProcessor.from_pretrained(path)}


def _omni_case(omni, text: str, image: bytes | None = None,
               audio: np.ndarray | None = None) -> tuple[dict, Reference]:
    """(what to send to llm, transformers' result) for one user turn."""
    from PIL import Image

    processor = omni["processor"]
    parts = ([{"type": "audio"}] if audio is not None else []) + (
        [{"type": "image"}] if image is not None else [])
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(image)).convert("RGB")] if image else None
    inputs = processor(text=prompt, images=pil, audio=[audio] if audio is not None else None,
                       return_tensors="pt")
    send: dict = {"prompt": prompt}
    if audio is not None:  # what audio_encoder hands the thinker: the clip's own frames
        frames = int(inputs["feature_attention_mask"][0].sum())
        send |= {"audio_features": inputs["input_features"][0, :, :frames].numpy(),
                 "audio_lengths": np.array([frames])}
    if image is not None:
        with torch.no_grad():
            rows = omni["thinker"].visual(inputs["pixel_values"],
                                          grid_thw=inputs["image_grid_thw"]).pooler_output
        send |= {"image_embeds": rows.numpy(), "grid_thw": inputs["image_grid_thw"].numpy()}
    return send, reference_generate(omni["thinker"], **inputs)


CASES = {
    "text": {},
    "text + image": {"image": png(100, 80)},
    "text + resized image": {"image": png(300, 200, seed=2)},
    "text + audio": {"audio": tone(1.0, freq=330.0)},
    "text + image + audio": {"image": png(300, 200, seed=2), "audio": tone(1.5, freq=220.0)},
}


@pytest.mark.parametrize("case", CASES)
def test_streamed_hidden_states_equal_transformers(omni, case):
    send, ref = _omni_case(omni, "what do you see and hear?", **CASES[case])
    served = serve(omni["url"], **send)
    assert_equal_to(served, ref)
    # streamed: each response brings the rows its tokens account for, no later: the
    # prompt's with the first token, then one per token (a response may carry several)
    prompt = len(ref.embeds) - len(ref.token_ids) + 1
    assert np.cumsum(served.rows_per_response).tolist() == [
        prompt + n - 1 for n in np.cumsum(served.tokens_per_response)]


def test_one_response_carries_every_row(omni):
    send, ref = _omni_case(omni, "describe it", png(100, 80, seed=3))
    served = serve(omni["url"], stream=False, **send)
    assert_equal_to(served, ref)
    assert len(served.rows_per_response) == 1


@pytest.mark.parametrize("concurrency", [2, 4])
def test_batched_requests_get_the_rows_each_gets_alone(omni, concurrency):
    cases = [_omni_case(omni, f"question number {i}", png(100, 80, seed=i) if i % 2 else None)
             for i in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        served = list(pool.map(lambda c: serve(omni["url"], **c[0]), cases))
    for got, (_, ref) in zip(served, cases, strict=True):
        assert_equal_to(got, ref)


LONG = ("Look at the picture and tell me, slowly and in order, every shape and colour in it, "
        "where each one sits, which is largest and which is smallest, what the light falls on, "
        "and what you think the whole picture would look like from the other side of the room, "
        "then say it all again in fewer words, as if to a child who cannot see it.")
BLOCK = 128  # vLLM's KV block on CPU: its prefix cache keeps whole blocks
HITS = "omni_llm_prefix_cache_hits_total"


def test_a_repeated_prompt_gets_its_cached_positions_rows(omni, omni_chat_server):
    """The second request finds the first's blocks in the prefix cache: the engine computes
    only the rest, and writes the cached positions' rows from those it kept of the first.
    (The cold rows are compared with transformers above, on shorter prompts: at this
    length fp32 CPU kernels drift past 1e-4 from transformers, cache or not.)"""
    def hits() -> float:
        return metric(omni_chat_server.metrics(), HITS, "llm")

    send, ref = _omni_case(omni, LONG, png(100, 80, seed=6))
    before = hits()
    first = serve(omni["url"], **send)
    between = hits()
    second = serve(omni["url"], **send)
    after = hits()
    assert first.error is None and second.error is None, (first.error, second.error)
    assert first.token_ids == second.token_ids == ref.token_ids
    assert len(ref.embeds) - len(ref.token_ids) + 1 >= BLOCK  # a whole block to find
    assert between == before and after - between >= BLOCK, (before, between, after)
    for cold, warm in zip(first.rows(), second.rows(), strict=True):
        assert cold.shape == warm.shape == ref.embeds.shape
        assert np.array_equal(cold[:BLOCK], warm[:BLOCK])  # the rows kept, as computed
        print(f"\nrows computed after the hit: max |warm - cold| "
              f"{np.abs(cold[BLOCK:] - warm[BLOCK:]).max():.2e}")
        assert np.abs(cold[BLOCK:] - warm[BLOCK:]).max() <= TOLERANCE


@pytest.mark.parametrize("stream", [True, False])
def test_a_caller_on_this_host_reads_the_rows_from_shared_memory(omni, stream):
    send, ref = _omni_case(omni, "no copies, please", png(100, 80, seed=4))
    served = serve(omni["url"], in_shm=True, stream=stream, **send)
    assert_equal_to(served, ref)
    [path] = served.files  # one file for the whole request, the caller's now
    assert Path(path).parent.name.startswith("omni_hs_") and Path(path).exists()
    Path(path).unlink()


def test_the_stage_owns_the_capture_argument(omni):
    served = serve(omni["url"], prompt="hi", sampling={
        "max_tokens": 2, "extra_args": {"omni_hidden_states": "../../etc/x"}})
    assert served.error is not None
    assert "sampling_parameters.extra_args.omni_hidden_states: is set by the stage" in str(
        served.error)


# --- a text-only Qwen2 (text-chat's llm): embeddings from the token ids -------------------------

def test_a_text_model_streams_its_hidden_states_too(text_chat_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_model("qwen2-tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer("the quick brown fox")["input_ids"]
    ref = reference_generate(model, input_ids=torch.tensor([ids]),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert_equal_to(serve(text_chat_server.grpc_url, prompt_ids=ids), ref)
