"""What every backends/*/model.py adapter does the same way (runs in its Triton stub).

`StageModel` is the base of each backend's TritonPythonModel: Triton's
`auto_complete_config` from the stage's tensor contract, and `set_up(args)` at
the start of `initialize`: the stage's logging into Triton's log, the spec's
environment, the stub registry (stages the orchestrator calls register, so it
learns when a stub dies), the model name, and for a decoupled stage the check
of its transaction policy and the ResponseSender its responses go through.
"""
from __future__ import annotations

import json
import os

from omni_serve import stubs
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
        if self.CONTRACT.decoupled:
            if not pb().using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
                raise pb().TritonModelException(
                    f"{self.model_name}: {backend} needs model_transaction_policy "
                    "{ decoupled: true }")
            self.sender = ResponseSender(
                self.model_name, cancel_poll_s=float(os.environ.get("OMNI_CANCEL_POLL_S", "0.1")))
