"""The talker engine's per-step input: the thinker's reply vectors, as they stream in.

Runs in the talker's vLLM engine-core process (on CPU and with one GPU, the
worker runs there too). Qwen2.5-Omni's talker adds, at every decode step, one
vector of the thinker's reply (hidden state + input embedding of the next
reply token), which vLLM has no input for. Two pieces supply it:

- `TalkerScheduler` (the engine's `scheduler_cls`): a running talker request
  whose next reply vector the thinker has not written yet is left out of the
  step (it keeps its KV cache; the others in the batch go on), so the talker
  starts on the first reply tokens and never reads a vector that is not there.
- `TalkerExtension` (the worker's `worker_extension_cls`): before each forward,
  it builds, for the step's flattened tokens, the extra vectors
  (`OmniTalker.omni_extra`) and the request's 3D M-RoPE positions.

Where the vectors come from: the thinker engine's hidden-state capture file
(llm/hidden_states.py), one row [embedding | hidden] per thinker position, on
the same host (`/dev/shm`); the thinker stage writes `<file>.rows` with the
final row count when its request ends. Talker position q (>= the prompt
length) reads thinker row q - 1; the row just past the last one is the
text-eos embedding, any later one the text-pad embedding (transformers'
`thinker_reply_part`).

What a request carries (`SamplingParams.extra_args[EXTRA_ARG]`, set by the
talker stage, families/qwen2_5_omni/talker_prompt.py): file, width, prompt_len, positions (3 lists,
the prompt's M-RoPE positions) and delta (decode position q has q + delta).
"""
from __future__ import annotations

import logging
import os
import re

import numpy as np

from omni_serve.llm.hidden_states import ended_rows, read_rows, rows_in
from omni_serve.talker import step_feed

log = logging.getLogger("vllm.omni_talker")

EXTRA_ARG = "omni_talker"
SCHEDULER = "omni_serve.families.qwen2_5_omni.talker_engine.TalkerScheduler"
EXTENSION = "omni_serve.families.qwen2_5_omni.talker_engine.TalkerExtension"
RPC = "omni_install_talker_feed"
# only capture files of a hidden-states directory (hidden_states.make_directory)
_SOURCE = re.compile(r"^/(dev/shm|tmp)/[^/]*omni_hs_[A-Za-z0-9_]+/[A-Za-z0-9_-]{1,64}$")


def valid_source(path: str) -> bool:
    return isinstance(path, str) and bool(_SOURCE.match(path)) and ".." not in path


def feed_of(request) -> dict | None:
    return step_feed.feed_of(request, EXTRA_ARG)


def vector_ready(feed: dict, position: int) -> bool:
    """Can talker position `position` be computed now?"""
    if position < feed["prompt_len"]:
        return True
    have = rows_in(feed["file"], feed["width"])
    if have is not None and position - 1 < have:
        return True
    return ended_rows(feed["file"]) is not None


# --- the scheduler (engine-core process) -------------------------------------------------

class TalkerScheduler(step_feed.HoldingScheduler):
    """vLLM's scheduler, minus the running requests whose next step's input the thinker has
    not written yet (omni_serve.talker.step_feed)."""

    def ready(self, request) -> bool:
        feed = feed_of(request)
        return feed is None or vector_ready(feed, request.num_computed_tokens)


# --- the worker extension (worker process) -----------------------------------------------

class TalkerExtension:
    """Mixed into vLLM's Worker class (`worker_extension_cls`)."""

    def omni_install_talker_feed(self) -> str:
        runner = getattr(self, "model_runner", None)
        problem = step_feed.runner_problem(runner, "tail_embeds", "the omni talker")
        if problem:
            return problem
        if getattr(runner, "_omni_talker_feed", None) is None:
            runner._omni_talker_feed = _StepFeed(runner)
            log.info("omni: talker reads the thinker's reply vectors (pid %d)", os.getpid())
        return ""


class _StepFeed:
    def __init__(self, runner):
        self.runner = runner
        self.scheduler_output = None
        forward, execute = runner._model_forward, runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self.scheduler_output = scheduler_output
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                self.scheduler_output = None

        def _model_forward(*args, **kwargs):
            if self.scheduler_output is not None:
                try:
                    self.prepare(kwargs)
                except Exception:  # never kill the engine (and every request on it) for one feed
                    log.exception("omni: the talker feed failed; this step runs without it")
                    self.runner.model.omni_extra = None
            return forward(*args, **kwargs)

        runner.execute_model = execute_model
        runner._model_forward = _model_forward

    def _spans(self):
        """(feed, first row in the step's batch, tokens, first position) per talker request."""
        out, offset = [], 0
        sched = self.scheduler_output
        computed = {r.req_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
        cached = sched.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id in self.runner.input_batch.req_ids:
            n = sched.num_scheduled_tokens.get(req_id, 0)
            feed = feed_of(self.runner.requests.get(req_id))
            if feed is not None and n:
                out.append((feed, offset, n, computed[req_id]))
            offset += n
        return out

    def prepare(self, kwargs: dict) -> None:
        import torch

        spans = self._spans()
        if not spans:
            return
        model = self.runner.model
        embeds = kwargs.get("inputs_embeds")
        rows = embeds.shape[0] if embeds is not None else kwargs["input_ids"].shape[0]
        extra = torch.zeros(rows, model.tail_embeds.shape[1], dtype=torch.float32)
        positions = kwargs.get("positions")
        if positions is not None and positions.ndim == 2:
            positions = positions.clone()
        for feed, first, n, start in spans:
            vectors, pos = reply_vectors(feed, start, n, model.tail_embeds.float().cpu().numpy())
            extra[first:first + n] = torch.from_numpy(vectors)
            if positions is not None and positions.ndim == 2:
                positions[:, first:first + n] = torch.from_numpy(pos).to(positions.device)
        model.omni_extra = extra.to(model.tail_embeds.device)
        if positions is not None:
            kwargs["positions"] = positions


def reply_vectors(feed: dict, start: int, n: int, tail: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(extra [n, E] float32, positions [3, n] int64) of talker positions start..start+n-1."""
    width, prompt_len = feed["width"], feed["prompt_len"]
    half = width // 2
    extra = np.zeros((n, half), np.float32)
    pos = np.empty((3, n), np.int64)
    prompt = np.asarray(feed["positions"], np.int64)
    for k, q in enumerate(range(start, start + n)):
        if q < prompt_len:
            pos[:, k] = prompt[:, q]
        else:
            pos[:, k] = q + feed["delta"]
    decode = [q for q in range(start, start + n) if q >= prompt_len]
    if decode:
        final = ended_rows(feed["file"])
        have = (rows_in(feed["file"], width) or 0) if final is None else max(final, 0)
        wanted = [q - 1 for q in decode if q - 1 < have]
        data = None
        if wanted:
            data = read_rows(feed["file"], wanted[0], len(wanted), width)
            if data is None:  # removed as we read: its request is over, run out on pad
                final, have, wanted = -1, 0, []
            else:
                data = data[:, :half] + data[:, half:]
        for q in decode:
            k, row = q - start, q - 1
            if row < have:
                extra[k] = data[row - wanted[0]]
            elif final is not None:
                extra[k] = tail[0] if row == final else tail[1]
            else:
                log.error("omni: talker position %d ran before thinker row %d arrived", q, row)
                extra[k] = tail[1]
    return extra, pos
