"""The tiny Qwen2.5-Omni tokenizer's chat prompt, for the orchestrator's unit tests
(the template the generated repositories render the thinker's prompts with)."""
from __future__ import annotations

import functools

from omni_serve.orchestrator.prompt import ChatPrompt
from omni_tools.tiny_omni import build_omni_tokenizer


@functools.cache
def tiny_chat_prompt() -> ChatPrompt:
    return ChatPrompt(build_omni_tokenizer(), source="the tiny omni tokenizer")
