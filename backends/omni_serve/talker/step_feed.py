"""What every family's talker engine shares: holding a request until its next input exists,
and the checks before a per-step feed is installed in vLLM's model runner.

A talker is fed, step by step, what the thinker has written so far (a family's
talker_engine.py says what and from where). Runs in the talker's vLLM processes:
- `HoldingScheduler` (engine core): vLLM's scheduler minus the running requests whose
  next step cannot be computed yet (`ready` is the family's); they keep their KV cache
  and slot, the rest of the batch goes on, and an engine where every request waits
  sleeps `IDLE_SLEEP_S` instead of spinning its core.
- `runner_problem` (worker): why a model runner cannot take a per-step feed.
- `feed_of`: a request's feed, the dict its SamplingParams.extra_args holds under a key.
"""
from __future__ import annotations

import time
from typing import Any

IDLE_SLEEP_S = 0.001  # every running request waits on the thinker: poll again after this
# what a per-step feed wraps or reads in vLLM's V1 GPU/CPU model runner
RUNNER_ATTRIBUTES = ("_model_forward", "execute_model", "input_batch", "requests")


def feed_of(request: Any, key: str) -> dict | None:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    feed = extra.get(key)
    return feed if isinstance(feed, dict) else None


def runner_problem(runner: Any, model_attribute: str, model_name: str) -> str:
    """'' when `runner` is vLLM's V1 runner of a model with `model_attribute`, else why not."""
    missing = [a for a in RUNNER_ATTRIBUTES if not hasattr(runner, a)]
    if missing:
        return (f"the model runner {type(runner).__name__} has no {', '.join(missing)} "
                "(vLLM's V1 GPU/CPU runner is needed)")
    if not hasattr(runner.model, model_attribute):
        return f"the model {type(runner.model).__name__} is not {model_name}"
    return ""


def _scheduler_base():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


class HoldingScheduler(_scheduler_base()):
    """vLLM's scheduler, minus the running requests that are not `ready` for their next step."""

    def ready(self, request: Any) -> bool:
        raise NotImplementedError

    def schedule(self, *args, **kwargs):
        held = [r for r in self.running if not self.ready(r)]
        if not held:
            return super().schedule(*args, **kwargs)
        ids = {id(r) for r in held}
        order = list(self.running)
        self.running = [r for r in order if id(r) not in ids]
        # the held requests still hold their slots: admit no more than with them
        saved = self.max_num_running_reqs, self.max_num_active_reqs
        self.max_num_running_reqs -= len(held)
        self.max_num_active_reqs -= len(held)
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.max_num_running_reqs, self.max_num_active_reqs = saved
            admitted = [r for r in self.running if r not in order]
            kept = [r for r in order if r in self.running or id(r) in ids]
            self.running = kept + admitted
        if out.total_num_scheduled_tokens == 0 and not self.waiting:
            time.sleep(IDLE_SLEEP_S)  # all wait on the thinker: do not spin the core
        return out
