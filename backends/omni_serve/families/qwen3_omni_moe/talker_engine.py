"""The Qwen3-Omni talker engine's per-step feed and its residual-code side channel.

Runs in the talker's vLLM engine-core process (on CPU and with one GPU, the
worker runs there too). vLLM samples code 0 of each frame; the model
(families/qwen3_omni_moe/talker_model.py) draws codes 1..15 of that frame in
the next step's forward. Two pieces feed it:

- `TalkerScheduler` (the engine's `scheduler_cls`): a running request whose
  next frame's text the thinker has not written yet is left out of the step
  (it keeps its KV cache; the others in the batch go on).
- `TalkerExtension` (the worker's `worker_extension_cls`, installed once with
  `collective_rpc(RPC)`) wraps the model runner. Before each forward it hands
  the model a `TalkerStep`: for each decode row (talker position q >= the
  prompt length: its input id is code 0 of frame f = q - prompt_len) the
  request's talker hidden state of its previous step and the thinker
  embedding of frame f's text (transformers' `trailing_text_hidden`: the
  assistant turn's tokens from its 5th on, the reply's last one left unfed,
  then tts_eos, then tts_pad for ever). After the forward it keeps each
  request's last hidden state and writes the codes drawn for frame f, int32
  [groups - 1], at offset f of the request's codes file, before the step's
  sampled tokens leave the engine: the stage that sees code 0 of frame f + 1
  finds frame f's residual codes. A recomputed (preempted) request re-embeds
  the frames it drew before.

What a request carries (`SamplingParams.extra_args[EXTRA_ARG]`, set by the
talker stage, families/qwen3_omni_moe/talker_prompt.py): prompt_len, pad_id,
codes_file (an existing file in a hidden-states directory); the text as
`text_ids` (the whole list) or streamed: `file` (the thinker's handed-over
capture file, llm/hidden_states.py: rows [embedding | hidden], `<file>.rows`
once it ends), width, first_row (the thinker row of frame 0's text) and
eos_id; optionally positions (3 lists, the prompt's M-RoPE positions) and
delta (decode position q has q + delta) for a prompt with media, and
residual_sampling ({temperature, top_k, top_p, seed}, or None: greedy) over
what its SamplingParams imply (transformers' code predictor settings when it
samples, seeded by its seed). Its residual codes are drawn from its own
generator, frame after frame, so a seeded request gets the same codes alone or
in any batch.
"""
from __future__ import annotations

import logging
import os
import re

import numpy as np

from omni_serve.llm.hidden_states import ended_rows, read_rows, rows_in
from omni_serve.talker import step_feed

log = logging.getLogger("vllm.omni_talker")

EXTRA_ARG = "omni_talker_qwen3"
SCHEDULER = "omni_serve.families.qwen3_omni_moe.talker_engine.TalkerScheduler"
EXTENSION = "omni_serve.families.qwen3_omni_moe.talker_engine.TalkerExtension"
RPC = "omni_install_qwen3_talker_feed"
STATS_RPC = "omni_qwen3_talker_stats"
CODE_DTYPE = np.dtype(np.int32)
# transformers' code predictor when the talker samples (the talker's
# prepare_inputs_for_generation): its own temperature 1, top-k 50, top-p 0.8
RESIDUAL_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.8}
# only files of a hidden-states directory (hidden_states.make_directory)
_SHM_FILE = re.compile(r"^/(dev/shm|tmp)/[^/]*omni_hs_[A-Za-z0-9_]+/[A-Za-z0-9_-]{1,64}$")


def valid_shm_file(path: str) -> bool:
    return isinstance(path, str) and bool(_SHM_FILE.match(path)) and ".." not in path


def feed_of(request) -> dict | None:
    return step_feed.feed_of(request, EXTRA_ARG)


def residual_settings(feed: dict, params) -> dict | None:
    """How a request draws its residual codes: the feed's `residual_sampling` if set, else
    transformers' code predictor settings when the request samples (seeded by its seed)."""
    if "residual_sampling" in feed:
        return feed["residual_sampling"]
    if params is None or getattr(params, "temperature", 0.0) < 1e-5:  # vLLM's greedy
        return None
    return {**RESIDUAL_SAMPLING, "seed": getattr(params, "seed", None)}


def text_of(feed: dict, frame: int) -> int | np.ndarray | None:
    """Frame `frame`'s text: a thinker id, a thinker embedding row, or None (not there yet).

    From `text_ids` (the whole list) or, streamed, from the thinker's capture file: row
    `first_row + frame`'s embedding; the row just past the thinker's last is tts_eos, any
    later one tts_pad (transformers' trailing_text_hidden, its last reply token unfed).
    """
    if "text_ids" in feed:
        ids = feed["text_ids"]
        return int(ids[frame]) if frame < len(ids) else int(feed["pad_id"])
    row, path, width = feed["first_row"] + frame, feed["file"], feed["width"]
    final = ended_rows(path)
    if final is None or row < final:
        data = read_rows(path, row, 1, width) if (rows_in(path, width) or 0) > row else None
        if data is not None:
            return data[0, : width // 2]
        if final is None:
            return None
        final = -1  # removed as we read: its request is over, run out on pad
    return int(feed["eos_id"]) if row == final else int(feed["pad_id"])


def text_ready(feed: dict, position: int) -> bool:
    """Can talker position `position` be computed now?"""
    if position < feed["prompt_len"] or "text_ids" in feed:
        return True
    row, path = feed["first_row"] + position - feed["prompt_len"], feed["file"]
    return (rows_in(path, feed["width"]) or 0) > row or ended_rows(path) is not None


def read_codes(path: str, groups: int) -> np.ndarray:
    """The residual codes written so far, int32 [frames, groups - 1] (stage side)."""
    data = np.fromfile(path, dtype=CODE_DTYPE)
    width = groups - 1
    return data[: len(data) // width * width].reshape(-1, width)


# --- the scheduler (engine-core process) -------------------------------------------------

class TalkerScheduler(step_feed.HoldingScheduler):
    """vLLM's scheduler, minus the running requests whose next step's input the thinker has
    not written yet (omni_serve.talker.step_feed)."""

    def ready(self, request) -> bool:
        feed = feed_of(request)
        return feed is None or text_ready(feed, request.num_computed_tokens)


# --- the worker extension (worker process) -----------------------------------------------

class TalkerExtension:
    """Mixed into vLLM's Worker class (`worker_extension_cls`)."""

    def omni_install_qwen3_talker_feed(self) -> str:
        runner = getattr(self, "model_runner", None)
        problem = step_feed.runner_problem(runner, "code_predictor", "the Qwen3-Omni talker")
        if problem:
            return problem
        if getattr(runner, "_omni_qwen3_talker_feed", None) is None:
            runner._omni_qwen3_talker_feed = _StepFeed(runner)
            log.info("omni: the Qwen3-Omni talker draws residual codes in the step (pid %d)",
                     os.getpid())
        return ""


    def omni_qwen3_talker_stats(self) -> dict:
        """Counts since the feed was installed: frames drawn, and frames re-embedded from
        their codes (recomputed requests: preemptions)."""
        feed = getattr(getattr(self, "model_runner", None), "_omni_qwen3_talker_feed", None)
        return dict(feed.stats) if feed is not None else {}


class _Request:
    """What the worker keeps of one talker request between its steps."""

    def __init__(self):
        self.hidden = None  # the talker's hidden state at its last computed position
        self.hidden_position = -1
        self.codes: dict[int, np.ndarray] = {}  # frame -> its residual codes
        self.generator = None  # its residual sampling's, drawn from frame by frame

    def noise(self, settings: dict, shape: tuple[int, int]):
        """Exp(1) draws of its next frame, from its own generator (seeded by `seed`)."""
        import torch

        if self.generator is None:
            seed = settings.get("seed")
            self.generator = torch.Generator()
            self.generator.manual_seed(int(seed) if seed is not None
                                       else int.from_bytes(os.urandom(8), "little") >> 1)
        return torch.empty(shape).exponential_(generator=self.generator)


class _StepFeed:
    def __init__(self, runner):
        self.runner = runner
        self.scheduler_output = None
        self.state: dict[str, _Request] = {}
        self.stats = {"drawn_frames": 0, "recomputed_frames": 0}
        forward, execute = runner._model_forward, runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
                self.state.pop(req_id, None)
            self.scheduler_output = scheduler_output
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                self.scheduler_output = None

        def _model_forward(*args, **kwargs):
            spans = self._spans() if self.scheduler_output is not None else []
            plan = None
            if spans:
                try:
                    plan = self.prepare(spans, kwargs)
                except Exception:  # never kill the engine (and every request on it) for one feed
                    log.exception("omni: the Qwen3 talker feed failed; this step runs without it")
                    self.runner.model.omni_step = None
            out = forward(*args, **kwargs)
            if spans:
                try:
                    self.collect(spans, plan, out)
                except Exception:
                    log.exception("omni: keeping the Qwen3 talker's step results failed")
            return out

        runner.execute_model = execute_model
        runner._model_forward = _model_forward

    def _spans(self) -> list[tuple[str, dict, int, int, int]]:
        """(req_id, feed, first row in the step's batch, tokens, first position) per request."""
        out, offset = [], 0
        sched = self.scheduler_output
        computed = {r.req_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
        cached = sched.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id in self.runner.input_batch.req_ids:
            n = sched.num_scheduled_tokens.get(req_id, 0)
            feed = feed_of(self.runner.requests.get(req_id))
            if feed is not None and n:
                out.append((req_id, feed, offset, n, computed[req_id]))
            offset += n
        return out

    # before the forward
    def prepare(self, spans, kwargs: dict) -> list[tuple[str, dict, int]]:
        """Hand the model this step's `TalkerStep`; returns the (req_id, feed, frame) of
        each row whose codes it draws, in the model's order."""
        import torch

        from omni_serve.families.qwen3_omni_moe.talker_model import TalkerStep

        model = self.runner.model
        draw, draw_hidden, draw_text, plan, sampling = [], [], [], [], []
        known, known_codes, known_text = [], [], []
        positions = kwargs.get("positions")
        if positions is not None and positions.ndim == 2:
            positions = positions.clone()
        for req_id, feed, first, n, start in spans:
            state = self.state.setdefault(req_id, _Request())
            try:
                rows = self._rows(req_id, feed, state, first, n, start)
            except Exception:  # that request's steps go wrong; the others' do not
                log.exception("omni: talker request %s: its step's feed failed", req_id)
                continue
            for kind, row, frame, text in rows:
                if kind == "known":
                    known.append(row)
                    known_codes.append(state.codes[frame])
                    known_text.append(text)
                else:
                    draw.append(row)
                    draw_hidden.append(state.hidden)
                    draw_text.append(text)
                    plan.append((req_id, feed, frame))
                    params = getattr(self.runner.requests.get(req_id), "sampling_params", None)
                    sampling.append((state, residual_settings(feed, params)))
            if "positions" in feed and positions is not None and positions.ndim == 2:
                prompt_len, prompt = feed["prompt_len"], np.asarray(feed["positions"], np.int64)
                pos = np.array([prompt[:, q] if q < prompt_len else [q + feed["delta"]] * 3
                                for q in range(start, start + n)], np.int64).T
                positions[:, first:first + n] = torch.from_numpy(pos).to(positions.device)
        if positions is not None and positions.ndim == 2:
            kwargs["positions"] = positions
        self.stats["drawn_frames"] += len(draw)
        self.stats["recomputed_frames"] += len(known)
        if not draw and not known:
            model.omni_step = None
            return plan
        device = model.codec_head.weight.device
        width = model.config.text_config.hidden_size
        model.omni_step = TalkerStep(
            rows=torch.tensor(draw, dtype=torch.long, device=device),
            past_hidden=(torch.stack(draw_hidden) if draw_hidden
                         else torch.zeros(0, width, device=device)),
            text_embeds=text_embeds(model, draw_text + known_text, device),
            known_rows=torch.tensor(known, dtype=torch.long, device=device) if known else None,
            known_codes=(torch.from_numpy(np.stack(known_codes)).long().to(device)
                         if known else None),
            sampling=residual_sampling(sampling, model, device))
        return plan

    @staticmethod
    def _rows(req_id: str, feed: dict, state: _Request, first: int, n: int, start: int) -> list:
        """("known" | "draw", batch row, frame, text) of the request's decode rows this step.

        A frame drawn before (a recomputed request) is re-embedded from its codes; the one
        frame not drawn yet is drawn from the hidden state kept at the position before it
        (the last one computed, also after a preemption: vLLM recomputes up to it).
        """
        out = []
        for k, q in enumerate(range(start, start + n)):
            frame = q - feed["prompt_len"]
            if frame < 0:
                continue
            text = text_of(feed, frame)
            if text is None:
                raise RuntimeError(f"frame {frame} ran before its text arrived")
            if frame in state.codes:
                out.append(("known", first + k, frame, text))
            elif state.hidden is not None and state.hidden_position == q - 1:
                out.append(("draw", first + k, frame, text))
            else:
                raise RuntimeError(f"talker request {req_id}: frame {frame} has neither codes "
                                   "nor the hidden state of the position before it")
        return out

    # after the forward
    def collect(self, spans, plan, out) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        for req_id, _feed, first, n, start in spans:
            state = self.state.setdefault(req_id, _Request())
            state.hidden = hidden[first + n - 1].detach().clone()
            state.hidden_position = start + n - 1
        codes = self.runner.model.residual_codes
        if not plan or codes is None:
            return
        codes = codes.to("cpu", dtype=torch_int32()).numpy()
        for (req_id, feed, frame), row in zip(plan, codes, strict=True):
            self.state[req_id].codes[frame] = row.astype(np.int64)
            write_codes(feed.get("codes_file"), frame, row)


def text_embeds(model, texts: list, device):
    """[rows, thinker hidden] of thinker ids (embedded here) and thinker embedding rows."""
    import torch

    out = torch.empty(len(texts), model.thinker_embed.embedding_dim, device=device,
                      dtype=model.thinker_embed.weight.dtype)
    where = [i for i, t in enumerate(texts) if isinstance(t, int)]
    if where:
        ids = torch.tensor([texts[i] for i in where], dtype=torch.long, device=device)
        out[torch.tensor(where, device=device)] = model.thinker_embed(ids)
    for i, t in enumerate(texts):
        if t is None:
            raise RuntimeError("a talker step ran before its frame's text arrived")
        if not isinstance(t, int):
            out[i] = torch.from_numpy(np.asarray(t)).to(out)
    return out


def residual_sampling(rows: list[tuple[_Request, dict | None]], model, device):
    """The `ResidualSampling` of the step's drawn rows (None when all are greedy)."""
    if not any(settings for _, settings in rows):
        return None
    import torch

    from omni_serve.families.qwen3_omni_moe.talker_model import ResidualSampling

    predictor = model.code_predictor
    shape = (predictor.groups - 1, predictor.lm_head[0].out_features)
    on = [bool(s) for _, s in rows]
    cfg = [s or {} for _, s in rows]
    noise = [state.noise(s, shape) if s else torch.ones(shape) for state, s in rows]
    return ResidualSampling(
        sampled=torch.tensor(on, device=device),
        temperature=torch.tensor([float(c.get("temperature", 1.0)) for c in cfg], device=device),
        top_k=torch.tensor([int(c.get("top_k", 0)) for c in cfg], device=device),
        top_p=torch.tensor([float(c.get("top_p", 1.0)) for c in cfg], device=device),
        noise=torch.stack(noise).to(device))


def torch_int32():
    import torch

    return torch.int32


def write_codes(path: str | None, frame: int, row: np.ndarray) -> None:
    """Frame `frame`'s residual codes at their offset of an existing codes file."""
    if not valid_shm_file(path):
        return
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return  # its request has ended
    try:
        data = np.ascontiguousarray(row, dtype=CODE_DTYPE)
        os.pwrite(fd, data.tobytes(), frame * data.nbytes)
    finally:
        os.close(fd)
