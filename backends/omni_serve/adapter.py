"""What every backends/*/model.py adapter does the same way (runs in its Triton stub).

`StageModel` is the base of each backend's TritonPythonModel: Triton's
`auto_complete_config` from the stage's tensor contract, and `set_up(args)` at
the start of `initialize`: the stage's logging into Triton's log, the spec's
environment, the stub registry (stages the orchestrator calls register, so it
learns when a stub dies), the model name, the server's model-control mode, and
for a decoupled stage the check of its transaction policy and the ResponseSender
its responses go through. `take_out_of_service` is what a stage whose engine died
does with its model: unload it under explicit model control, nothing elsewhere.
"""
from __future__ import annotations

import json
import threading

from omni_serve import env, server_args, stubs
from omni_serve.contract import StageContract
from omni_serve.triton_log import log_to_triton
from omni_serve.tritonio import ResponseSender, apply_stage_env, auto_complete, pb


class StageModel:
    CONTRACT: StageContract
    WATCHED = True  # registers its stub with omni_serve.stubs

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """What config.pbtxt leaves out comes from the contract (a bare config loads)."""
        return auto_complete(auto_complete_model_config, cls.CONTRACT)

    def set_up(self, args: dict) -> None:
        backend = self.CONTRACT.backend
        log_to_triton(backend)
        apply_stage_env(args)
        if self.WATCHED:
            stubs.register(args)
        self.model_name = args["model_name"]
        # read once, before anything may need it: whether this model may unload itself
        self.model_control = server_args.model_control_mode()
        if self.CONTRACT.decoupled:
            if not pb().using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
                raise pb().TritonModelException(
                    f"{self.model_name}: {backend} needs model_transaction_policy "
                    "{ decoupled: true }")
            self.sender = ResponseSender(
                self.model_name, cancel_poll_s=float(env.CANCEL_POLL_S.get()))

    def take_out_of_service(self, why: str) -> None:
        """The model's engine died (`why`, naming the stage): its requests already fail
        UNAVAILABLE. Under --model-control-mode=explicit the model unloads itself, as
        vllm_backend's does (readiness off; a load brings a fresh engine). In any other
        mode it stays loaded and never asks to unload: Triton would refuse, and on 2.51
        that refused call from the stub could crash it (server_args.may_unload_itself)."""
        if not server_args.may_unload_itself(self.model_control):
            pb().Logger.log_error(
                f"{self.model_name}: {why}; it answers UNAVAILABLE until the server restarts "
                f"(model-control mode {self.model_control!r}: only 'explicit' lets it unload "
                f"and load again)")
            return

        def unload():
            try:
                pb().unload_model(self.model_name)
                pb().Logger.log_error(f"{self.model_name}: {why}; unloading it")
            except Exception as e:
                pb().Logger.log_error(f"{self.model_name}: {why}; it answers UNAVAILABLE "
                                      f"(it could not unload itself: {e})")

        threading.Thread(target=unload, name=f"{self.model_name}-unload", daemon=True).start()
