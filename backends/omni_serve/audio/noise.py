"""The noise a chunk of a sampling codec decoder starts from: its rows of the whole utterance's draw.

Runs in the omni_audio stub (a family's `CodecDecoder` that samples, e.g. by
flow matching, calls it) and in tests. A reference implementation draws one
`torch.randn([1, frames * rows_per_frame, width])` per utterance after
`torch.manual_seed(S)`. CPU `torch.randn` is prefix-stable when both sizes are
multiples of 16 values (it fills 16 at a time, the last partial group
differently): a draw of F0 frames is the first F0 frames of a draw of
F1 > F0. So a chunk at stream position `offset` with n frames draws
(offset + n) frames from its own `torch.Generator().manual_seed(seed)`
(never the global RNG: several threads run) and keeps the last n: the rows
the whole utterance's draw has there, whatever the batch-mates and however
the stream was cut. If rows_per_frame * width is not a multiple of 16 only the
last rows of a chunk can differ from the whole draw (`prefix_stable` says
which; decoders warn at load). On CUDA the noise is still drawn on the CPU (a
reference on CUDA would draw on the CUDA generator, a different stream).
"""
from __future__ import annotations

import torch


def utterance_noise(seed: int, offset: int, frames: int, rows_per_frame: int,
                    width: int) -> torch.Tensor:
    """float32 [frames * rows_per_frame, width]: the utterance's noise at frames offset..offset+frames-1.

    The rows one draw `torch.randn([1, N * rows_per_frame, width])` after
    `torch.manual_seed(seed)` has there, for any utterance length N >= offset + frames.
    """
    gen = torch.Generator().manual_seed(seed)
    draw = torch.randn([1, (offset + frames) * rows_per_frame, width], generator=gen)
    return draw[0, offset * rows_per_frame:]


def prefix_stable(rows_per_frame: int, width: int) -> bool:
    """Whether every chunk's noise is exactly the whole utterance's (frames of 16k values)."""
    return rows_per_frame * width % 16 == 0
