"""The Qwen3-Omni talker engine's per-step feed and its residual-code side channel.

Runs in the talker's vLLM worker (on CPU and with one GPU, inside the engine-core
process). vLLM samples code 0 of each frame; the model
(families/qwen3_omni_moe/talker_model.py) draws codes 1..15 of that frame in
the next step's forward. `TalkerExtension` (the worker's `worker_extension_cls`,
installed once with `collective_rpc(RPC)`) wraps the model runner so that,
around every forward:

- before: for each decode row (talker position q >= the prompt length: the
  input id is code 0 of frame f = q - prompt_len) it hands the model a
  `TalkerStep`: the request's talker hidden state of its previous step, and
  the text id of frame f (reply token f + 1 of the thinker, then tts_eos,
  then tts_pad for ever: transformers' `trailing_text_hidden`);
- after: it keeps each request's last hidden state for its next step, and
  writes the codes drawn for frame f, int32 [groups - 1], at offset f of the
  request's codes file (before the step's sampled tokens leave the engine, so
  the stage that sees code 0 of frame f + 1 finds frame f's residual codes).
  A recomputed request (preempted) re-embeds the frames it drew before.

What a request carries (`SamplingParams.extra_args[EXTRA_ARG]`, set by the
talker stage): prompt_len, text_ids (thinker ids, one per frame; the whole
list in this version), pad_id, codes_file (an existing file in a
hidden-states directory, see llm/hidden_states.make_directory), and
optionally positions (3 lists, the prompt's M-RoPE positions) and delta
(decode position q has q + delta) for a prompt with media, and
residual_sampling ({temperature, top_k, top_p, seed}) when the request samples:
its residual codes are drawn from its own generator, frame after frame, so a
seeded request gets the same codes alone or in any batch.
"""
from __future__ import annotations

import logging
import os
import re

import numpy as np

log = logging.getLogger("vllm.omni_talker")

EXTRA_ARG = "omni_talker_qwen3"
EXTENSION = "omni_serve.families.qwen3_omni_moe.talker_engine.TalkerExtension"
RPC = "omni_install_qwen3_talker_feed"
CODE_DTYPE = np.dtype(np.int32)
# only files of a hidden-states directory (hidden_states.make_directory)
_CODES_FILE = re.compile(r"^/(dev/shm|tmp)/[^/]*omni_hs_[A-Za-z0-9_]+/[A-Za-z0-9_-]{1,64}$")


def valid_codes_file(path: str) -> bool:
    return isinstance(path, str) and bool(_CODES_FILE.match(path)) and ".." not in path


def feed_of(request) -> dict | None:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    feed = extra.get(EXTRA_ARG)
    return feed if isinstance(feed, dict) else None


def text_id(feed: dict, frame: int) -> int:
    ids = feed["text_ids"]
    return int(ids[frame]) if frame < len(ids) else int(feed["pad_id"])


def read_codes(path: str, groups: int) -> np.ndarray:
    """The residual codes written so far, int32 [frames, groups - 1] (stage side)."""
    data = np.fromfile(path, dtype=CODE_DTYPE)
    width = groups - 1
    return data[: len(data) // width * width].reshape(-1, width)


class TalkerExtension:
    """Mixed into vLLM's Worker class (`worker_extension_cls`)."""

    def omni_install_qwen3_talker_feed(self) -> str:
        runner = getattr(self, "model_runner", None)
        missing = [a for a in ("_model_forward", "execute_model", "input_batch", "requests")
                   if not hasattr(runner, a)]
        if missing:
            return (f"the model runner {type(runner).__name__} has no {', '.join(missing)} "
                    "(vLLM's V1 GPU/CPU runner is needed)")
        if not hasattr(runner.model, "code_predictor"):
            return f"the model {type(runner.model).__name__} is not the Qwen3-Omni talker"
        if getattr(runner, "_omni_qwen3_talker_feed", None) is None:
            runner._omni_qwen3_talker_feed = _StepFeed(runner)
            log.info("omni: the Qwen3-Omni talker draws residual codes in the step (pid %d)",
                     os.getpid())
        return ""


class _Request:
    """What the worker keeps of one talker request between its steps."""

    def __init__(self):
        self.hidden = None  # the talker's hidden state at its last computed position
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
            prompt_len = feed["prompt_len"]
            for k, q in enumerate(range(start, start + n)):
                if q < prompt_len:
                    continue
                frame = q - prompt_len
                if frame in state.codes:
                    known.append(first + k)
                    known_codes.append(state.codes[frame])
                    known_text.append(text_id(feed, frame))
                elif k == 0 and state.hidden is not None:
                    draw.append(first + k)
                    draw_hidden.append(state.hidden)
                    draw_text.append(text_id(feed, frame))
                    plan.append((req_id, feed, frame))
                    sampling.append((state, feed.get("residual_sampling")))
                else:
                    raise RuntimeError(f"talker request {req_id}: frame {frame} has neither "
                                       "codes nor the previous step's hidden state")
            if "positions" in feed and positions is not None and positions.ndim == 2:
                prompt = np.asarray(feed["positions"], np.int64)
                pos = np.array([prompt[:, q] if q < prompt_len else [q + feed["delta"]] * 3
                                for q in range(start, start + n)], np.int64).T
                positions[:, first:first + n] = torch.from_numpy(pos).to(positions.device)
        if positions is not None and positions.ndim == 2:
            kwargs["positions"] = positions
        if not draw and not known:
            model.omni_step = None
            return plan
        device = model.codec_head.weight.device
        width = model.config.text_config.hidden_size
        model.omni_step = TalkerStep(
            rows=torch.tensor(draw, dtype=torch.long, device=device),
            past_hidden=(torch.stack(draw_hidden) if draw_hidden
                         else torch.zeros(0, width, device=device)),
            text_ids=torch.tensor(draw_text + known_text, dtype=torch.long, device=device),
            known_rows=torch.tensor(known, dtype=torch.long, device=device) if known else None,
            known_codes=(torch.from_numpy(np.stack(known_codes)).long().to(device)
                         if known else None),
            sampling=residual_sampling(sampling, model, device))
        return plan

    # after the forward
    def collect(self, spans, plan, out) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        for req_id, _feed, first, n, _start in spans:
            self.state.setdefault(req_id, _Request()).hidden = hidden[first + n - 1].detach().clone()
        codes = self.runner.model.residual_codes
        if not plan or codes is None:
            return
        codes = codes.to("cpu", dtype=torch_int32()).numpy()
        for (req_id, feed, frame), row in zip(plan, codes, strict=True):
            self.state[req_id].codes[frame] = row.astype(np.int64)
            write_codes(feed.get("codes_file"), frame, row)


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
    if not valid_codes_file(path):
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
