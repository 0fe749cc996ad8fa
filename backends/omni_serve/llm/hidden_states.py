"""Hidden states out of the LLM core: each position's input embedding and final hidden state.

What a talker that reads the thinker's rows takes from it (a family's speech
feed asks for them; transformers' `hidden_states[0]` and `hidden_states[-1]`
of `generate(output_hidden_states=True)`, or `hidden_states[k]` where the
family's vLLM thinker class keeps layer k's output: its `omni_capture_layer`
and, after each forward, `omni_capture_hidden`, e.g. Qwen3-Omni's
accept_hidden_layer, families/qwen3_omni_moe/thinker.py):
one row per prompt position, then one per generated token as it is fed back
(so a reply of n tokens has prompt + n - 1 rows; the last token is never fed).

Runs in two processes, joined by one file per request in a directory under
/dev/shm (`OMNI_HIDDEN_STATES_DIR`, made by the stage before the engine starts,
so the engine core inherits it):
- vLLM's worker: `HiddenStatesExtension` is the engine's `worker_extension_cls`;
  `omni_capture_hidden_states()` (called once through `collective_rpc`) wraps
  the model runner's `_model_forward` (to keep the step's input embeddings and
  output hidden states) and `execute_model` (to write them out). After each
  step, every scheduled request whose `SamplingParams.extra_args` names a
  capture file gets its rows [embedding | hidden] (float32) written at their
  positions' offsets, before the step's tokens leave the engine. Writing by
  position makes a recomputed (preempted) request rewrite the same bytes.
- the omni_llm stage: `CaptureFile` creates the empty file before the request is
  submitted, reads the rows each output accounts for, and deletes it at the end.
  With `hidden_states_in_shm` it only waits until they are written and hands the
  file to the caller (same host), who reads the rows from it and deletes it:
  no copy of them in any response. A handed-over file left more than
  `HANDED_OVER_TTL_S` is removed when the next capture starts.
  The worker only writes files that exist, named by a plain token, in that
  directory: a request cannot make it write anywhere else.

A request that hits vLLM's prefix cache is not computed at its cached positions:
the worker writes their rows from the rows it kept of earlier requests' blocks
(llm/row_cache.py) before those it computes, or, when it kept none, marks the file
missed (`<file>.miss`) and the stage runs the request again without the cache.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import time

import numpy as np

from omni_serve import env
from omni_serve.llm import row_cache

log = logging.getLogger("vllm.omni_hidden_states")

ENV_DIR = env.HIDDEN_STATES_DIR.name
EXTRA_ARG = "omni_hidden_states"  # SamplingParams.extra_args key: the capture file's token
EXTENSION = "omni_serve.llm.hidden_states.HiddenStatesExtension"
RPC = "omni_capture_hidden_states"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ROW = np.dtype(np.float32)
HANDED_OVER_TTL_S = 600.0


# --- the worker side (vLLM's worker process) ---------------------------------------------

class HiddenStatesExtension:
    """Mixed into vLLM's Worker class by vLLM (`worker_extension_cls`)."""

    def omni_capture_hidden_states(self) -> str:
        """Install the capture on this worker's model runner (idempotent); '' when done,
        else why it cannot be."""
        runner = getattr(self, "model_runner", None)
        missing = [a for a in ("_model_forward", "execute_model", "input_batch", "requests")
                   if not hasattr(runner, a)]
        if missing:
            return (f"the model runner {type(runner).__name__} has no "
                    f"{', '.join(missing)} (vLLM's V1 GPU/CPU runner is needed)")
        directory = os.environ.get(ENV_DIR, "")
        if not os.path.isdir(directory):
            return f"{ENV_DIR} is not a directory: {directory!r}"
        if getattr(runner, "_omni_step_capture", None) is None:
            runner._omni_step_capture = _StepCapture(runner, directory)
            log.info("omni: hidden states captured for requests that ask (pid %d)", os.getpid())
        return ""


class _StepCapture:
    def __init__(self, runner, directory: str):
        self.runner = runner
        self.dir = directory
        self.last: tuple | None = None
        block_size = getattr(getattr(runner, "cache_config", None), "block_size", None)
        # without vLLM's KV block size there are no prefix-cache hits to fill: keep no rows
        self.cache = row_cache.RowBlockCache(row_cache.budget_bytes() if block_size else 0,
                                             block_size or 1)
        self.live: dict[str, row_cache.LiveRows] = {}  # capturing requests running
        forward, execute = runner._model_forward, runner.execute_model

        def _model_forward(*args, **kwargs):
            model = self._model()
            if model is not None:
                model.omni_capture_hidden = None
            out = forward(*args, **kwargs)
            # a model that keeps another layer's output for the rows (a family's thinker
            # class: omni_capture_hidden) hands that one over instead of its last
            kept = getattr(model, "omni_capture_hidden", None)
            self.last = (kwargs.get("input_ids"), kwargs.get("inputs_embeds"),
                         out if kept is None else kept)
            return out

        def execute_model(scheduler_output, *args, **kwargs):
            self.last = None
            if self.live:  # before the step forgets them: their rows go to the cache
                self.retire(scheduler_output.finished_req_ids)
            result = execute(scheduler_output, *args, **kwargs)
            if self.last is not None:
                try:
                    self.write(scheduler_output)
                except Exception:  # never fail the step: the stage reports missing rows
                    log.exception("omni: writing hidden states failed")
            return result

        runner._model_forward = _model_forward
        runner.execute_model = execute_model

    def _model(self):
        """The model itself (vLLM may wrap it), if it says which layer it keeps."""
        model = getattr(self.runner, "model", None)
        get = getattr(self.runner, "get_model", None)
        if get is not None:
            try:
                model = get()
            except Exception:  # no model loaded yet
                return None
        return model if getattr(model, "omni_capture_layer", None) is not None else None

    def _wanted(self, scheduler_output) -> list[tuple[str, int, int, int]]:
        """(token, first row in the step's batch, rows, first position) per capturing request."""
        wanted, offset = [], 0
        for req_id in self.runner.input_batch.req_ids:
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            state = self.runner.requests.get(req_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            token = extra.get(EXTRA_ARG)
            if isinstance(token, str) and _TOKEN.match(token) and n:
                wanted.append((token, offset, n, req_id))
            offset += n
        if not wanted:  # the common step: nobody asked, nothing more to look up
            return []
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return [(token, first, n, req_id, computed[req_id])
                for token, first, n, req_id in wanted]

    def write(self, scheduler_output) -> None:
        wanted = self._wanted(scheduler_output)
        if not wanted:
            return
        import torch

        input_ids, embeds, hidden = self.last
        if isinstance(hidden, tuple):  # (hidden, aux hidden states) with EAGLE-3
            hidden = hidden[0]
        for token, first, n, req_id, position in wanted:
            rows = slice(first, first + n)
            e = embeds[rows] if embeds is not None else self.runner.model.embed_input_ids(
                input_ids[rows])
            data = torch.cat([e, hidden[rows]], dim=-1).to(torch.float32).cpu().numpy()
            path = os.path.join(self.dir, token)
            if self.cache.budget:
                live = self.live.get(req_id)
                if live is None:
                    live = self.live[req_id] = row_cache.LiveRows(data.shape[1])
                    if position:
                        self._fill(req_id, live, position, path)
                if live.missed:
                    continue  # its stage recomputes it without the prefix cache
                live.add(position, data)
            _write_rows(path, position, data)

    # --- rows of prefix-cached positions (llm/row_cache.py) ---

    def _keys(self, state, tokens, blocks: int) -> list[bytes]:
        media = [(f.identifier, f.mm_position.offset, f.mm_position.length)
                 for f in (getattr(state, "mm_features", None) or ())]
        lora = getattr(state, "lora_request", None)
        return row_cache.block_keys(tokens, media, self.cache.block_size, blocks,
                                    salt=getattr(lora, "lora_name", "") or "")

    def _fill(self, req_id: str, live: row_cache.LiveRows, position: int, path: str) -> None:
        """Write the rows of a new request's first `position` (prefix-cached) positions from
        the cache; else mark it missed (`<file>.miss`): nothing more is written for it."""
        state = self.runner.requests.get(req_id)
        bs = self.cache.block_size
        rows = None
        if (state is not None and getattr(state, "prompt_embeds", None) is None
                and position % bs == 0):
            tokens = list(state.prompt_token_ids or ()) + list(state.output_token_ids)
            if len(tokens) >= position:
                rows = self.cache.get(self._keys(state, tokens, position // bs))
        if rows is None:
            live.missed = True
            _mark_missed(path)
            return
        live.add(0, rows)
        _write_rows(path, 0, rows)

    def retire(self, finished: set[str]) -> None:
        """Keep the whole blocks of rows of capturing requests that ended (finished or
        aborted). A preempted request stays: resumed, it goes on from its rows here."""
        for req_id in finished & self.live.keys():
            live = self.live.pop(req_id)
            state = self.runner.requests.get(req_id)
            if (state is None or live.missed
                    or getattr(state, "prompt_embeds", None) is not None):
                continue
            tokens = list(state.prompt_token_ids or ()) + list(state.output_token_ids)
            blocks = min(live.count, len(tokens)) // self.cache.block_size
            if blocks:
                self.cache.put(self._keys(state, tokens, blocks), live.rows())


def _write_rows(path: str, position: int, data: np.ndarray) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return  # its request has ended
    try:
        os.pwrite(fd, data.tobytes(), position * data.shape[1] * _ROW.itemsize)
    finally:
        os.close(fd)


MISSED_SUFFIX = ".miss"


def _mark_missed(path: str) -> None:
    """Tell the stage this request's prefix-cached rows are not to be had (only beside a
    capture file that exists)."""
    if not os.path.exists(path):
        return
    try:
        os.close(os.open(path + MISSED_SUFFIX, os.O_WRONLY | os.O_CREAT, 0o600))
    except OSError:
        log.exception("omni: marking %s missed failed", path)


# --- the stage side (the omni_llm stub process) --------------------------------------------

def make_directory() -> str:
    """A fresh directory for this stage's capture files, named in the environment."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="omni_hs_", dir=base)
    os.environ[ENV_DIR] = directory
    return directory


def remove_directory(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


class MissingRowsError(RuntimeError):
    """The engine did not write the rows an output accounts for."""


class CaptureFile:
    """One request's rows [embedding | hidden] (float32, `2 * hidden_size` wide)."""

    def __init__(self, directory: str, hidden_size: int):
        _remove_stale(directory)
        self.token = secrets.token_hex(12)
        self.path = os.path.join(directory, self.token)
        self.width = 2 * hidden_size
        self.rows_read = 0
        self.handed_over = False
        self.completed = False  # its request ended with a reply (not failed, not aborted)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    @staticmethod
    def expected_rows(prompt_tokens: int, output_tokens: int) -> int:
        """Rows the engine has computed once `output_tokens` tokens came out."""
        return prompt_tokens + output_tokens - 1 if output_tokens else 0

    def missed(self) -> bool:
        """Whether the engine hit the prefix cache for rows it did not keep (it then
        writes none: the request must be computed again without the cache)."""
        return os.path.exists(self.path + MISSED_SUFFIX)

    async def wait_for(self, rows: int, timeout_s: float = 5.0) -> None:
        """Until the file holds `rows` rows (the worker's write precedes the output that
        accounts for it, so normally no wait at all)."""
        size = rows * row_bytes(self.width)
        deadline = time.monotonic() + timeout_s
        while (stat := os.fstat(self._fd)).st_size < size:
            if stat.st_nlink == 0:
                # the caller removed the handed-over file (its request is over, e.g.
                # cancelled): the engine can no longer write to it, and nobody reads it
                return
            if time.monotonic() > deadline:
                have = os.fstat(self._fd).st_size // row_bytes(self.width)
                raise MissingRowsError(f"hidden states of positions {have}..{rows - 1} never "
                                       f"arrived from the engine")
            await asyncio.sleep(0.001)

    async def read_until(self, rows: int, timeout_s: float = 5.0) -> np.ndarray:
        """Rows [rows_read, rows) as a (k, width) float32 array."""
        if rows <= self.rows_read:
            return np.zeros((0, self.width), np.float32)
        await self.wait_for(rows, timeout_s)
        step = row_bytes(self.width)
        raw = os.pread(self._fd, (rows - self.rows_read) * step, self.rows_read * step)
        self.rows_read = rows
        return np.frombuffer(raw, np.float32).reshape(-1, self.width).copy()

    async def span_until(self, rows: int, timeout_s: float = 5.0) -> tuple[int, int, int]:
        """(first row, rows added, width) once rows [rows_read, rows) are in the file."""
        first = self.rows_read
        if rows > first:
            await self.wait_for(rows, timeout_s)
            self.rows_read = rows
        return first, max(0, rows - first), self.width

    def close(self) -> None:
        """Close it; delete it unless it was handed to a caller that still wants it.

        The caller of a request that failed or was aborted may never have learnt its
        name (it stopped reading), so such a file goes here.
        """
        os.close(self._fd)
        if os.path.exists(self.path + MISSED_SUFFIX):
            os.unlink(self.path + MISSED_SUFFIX)
        if not (self.handed_over and self.completed):
            remove_handed_over(self.path)


def _remove_stale(directory: str, ttl_s: float = HANDED_OVER_TTL_S) -> None:
    """Delete handed-over files their caller left behind (it died, or never read them)."""
    cutoff = time.time() - ttl_s
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        try:
            if entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass


# --- a handed-over file (read by any process on the host) -------------------------------
# The thinker stage's caller (the orchestrator) and the talker (stage and engine) read a
# handed-over file while the thinker's engine is still writing it; these are the only
# readers of its layout. When the thinker request ends, the stage writes the final row
# count beside it (`<file>.rows`); the caller removes both when its request is over.

ROWS_SUFFIX = ".rows"


def row_bytes(width: int) -> int:
    return width * _ROW.itemsize


def rows_in(path: str, width: int) -> int | None:
    """Whole rows in the file so far, None once it is gone."""
    try:
        return os.stat(path).st_size // row_bytes(width)
    except FileNotFoundError:
        return None


def read_rows(path: str, first: int, count: int, width: int) -> np.ndarray | None:
    """Rows [first, first + count) as a (count, width) float32 array; None when the file is
    gone or holds fewer rows."""
    size = count * row_bytes(width)
    try:
        with open(path, "rb") as f:
            raw = os.pread(f.fileno(), size, first * row_bytes(width))
    except FileNotFoundError:
        return None
    if len(raw) != size:
        return None
    return np.frombuffer(raw, np.float32).reshape(count, width).copy()


def split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input embeddings, hidden states) of rows [embedding | hidden]."""
    half = rows.shape[-1] // 2
    return rows[:, :half], rows[:, half:]


def write_final_rows(path: str, rows: int) -> None:
    """The thinker stage's last word on a handed-over file: how many rows it holds (nothing
    when its caller has removed it already: nobody reads the count then)."""
    if not os.path.exists(path):
        return
    tmp = f"{path}{ROWS_SUFFIX}.tmp"
    with open(tmp, "w") as f:
        f.write(str(rows))
    os.replace(tmp, path + ROWS_SUFFIX)
    if not os.path.exists(path):  # the caller removed both while this was written
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ROWS_SUFFIX)


def final_rows(path: str) -> int | None:
    """The thinker's final row count once its request has ended, else None."""
    try:
        with open(path + ROWS_SUFFIX) as f:
            return int(f.read().strip() or "-1")
    except (FileNotFoundError, ValueError):
        return None


def ended_rows(path: str) -> int | None:
    """The thinker's final row count, -1 once its file is gone (its caller removed it: the
    request is over), else None while it may still grow."""
    final = final_rows(path)
    if final is None and not os.path.exists(path):
        return -1
    return final


def remove_handed_over(path: str) -> None:
    """The caller's end of a handed-over file: delete it and its row count."""
    for name in (path, path + ROWS_SUFFIX):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
