"""ArrayInput: a tritonclient InferInput that keeps the numpy array it carries.

Runs in the caller's process, with no network I/O. The request builders
(_llm_io, _pipeline_io) make every input tensor one of these: the sync client
and unary calls hand them to tritonclient as they are, and AsyncOmniClient
streams through omni_serve.grpc_stream, which builds its request from numpy
arrays by name, read back here from `array` (tritonclient has no public
accessor for an InferInput's data).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import tritonclient.grpc as grpcclient


class ArrayInput(grpcclient.InferInput):
    """An InferInput set from `array` (of Triton `datatype`), which it keeps as `array`
    (None once the tensor is set to shared memory instead)."""

    def __init__(self, name: str, array: np.ndarray, datatype: str):
        super().__init__(name, list(array.shape), datatype)
        self.array: np.ndarray | None = None
        self.set_data_from_numpy(array)

    def set_data_from_numpy(self, input_tensor: np.ndarray) -> ArrayInput:
        super().set_data_from_numpy(input_tensor)
        self.array = input_tensor
        return self

    def set_shared_memory(self, region_name: str, byte_size: int, offset: int = 0) -> ArrayInput:
        super().set_shared_memory(region_name, byte_size, offset)
        self.array = None
        return self


def arrays_by_name(inputs: Iterable[grpcclient.InferInput]) -> dict[str, np.ndarray]:
    """The numpy arrays of `inputs`, by input name.

    Raises:
        TypeError: an input is not an ArrayInput holding its array.
    """
    arrays = {}
    for tensor in inputs:
        if not isinstance(tensor, ArrayInput) or tensor.array is None:
            raise TypeError(f"input {tensor.name()!r} is not an ArrayInput set from numpy")
        arrays[tensor.name()] = tensor.array
    return arrays
