"""Result types returned by omni_client calls (plain values, no tritonclient objects)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    """One streamed response of the LLM stage.

    Attributes:
        text: the text generated since the previous delta (may be empty).
        finish_reason: why generation stopped ("stop", "length", ...); None
            until the sequence finishes.
        num_input_tokens: prompt length in tokens, when the server reports it.
        num_output_tokens: output token count as the server reports it for
            this response, when it does.
    """

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(frozen=True)
class Completion:
    """The whole result of a non-streaming generation.

    Attributes:
        text: the generated text (the prompt excluded).
        finish_reason: why generation stopped ("stop", "length", ...), if reported.
        num_input_tokens: prompt length in tokens, if reported.
        num_output_tokens: number of generated tokens, if reported.
    """

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
