"""The types stage contracts are written in: one tensor (`TensorSpec`), one stage kind
(`StageContract`).

Imported with omni_serve.contract wherever it is: the repository generator,
the Triton stubs (backends/*/model.py) and omni_client. What flows through
it: a tensor's Triton model-config type, dims and flags go in; its
config.pbtxt `input`/`output` entry, wire dtype and numpy dtype come out.
Nothing here imports tritonserver or torch (tritonclient's dtype table only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from tritonclient.utils import triton_to_np_dtype

# Triton model-config data types used by the stages; the inference protocol's wire name
# is the same without "TYPE_" (TYPE_STRING travels as BYTES), its numpy dtype is
# tritonclient's.
TritonType = Literal["TYPE_STRING", "TYPE_BOOL", "TYPE_UINT32", "TYPE_INT32", "TYPE_INT64",
                     "TYPE_FP32", "TYPE_UINT8"]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of a stage (dims exclude the batch dim)."""

    name: str
    data_type: TritonType
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""
    # Variable-length input that Triton's dynamic batcher may batch with
    # other lengths (config.pbtxt `allow_ragged_batch`); the stage pads/splits.
    ragged: bool = False

    @property
    def np_dtype(self) -> type:
        return np.dtype(triton_to_np_dtype(self.wire_dtype)).type

    def config_entry(self, *, is_input: bool) -> dict:
        """This tensor as a config.pbtxt `input`/`output` entry (model_config JSON form)."""
        entry: dict = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        if is_input and self.optional:
            entry["optional"] = True
        if is_input and self.ragged:
            entry["allow_ragged_batch"] = True
        return entry

    @property
    def wire_dtype(self) -> str:
        return "BYTES" if self.data_type == "TYPE_STRING" else self.data_type.removeprefix("TYPE_")


Batching = Literal["engine", "triton"]


@dataclass(frozen=True)
class StageContract:
    """Inputs and outputs of one stage kind; `backend` is the config.pbtxt backend name.

    `batching`: "engine" when the stage's engine batches continuously by itself
    (vLLM), so Triton must hand requests over one by one (max_batch_size 0);
    "triton" when Triton's dynamic batcher forms the batches (generators,
    encoders), so dims above exclude the batch dimension.
    """

    backend: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    decoupled: bool = False
    batching: Batching = "triton"
    # The file that marks a usable checkpoint directory for this stage kind.
    checkpoint_marker: str = "config.json"

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorSpec:
        return next(t for t in self.outputs if t.name == name)
