"""The thinker's chat prompt, rendered by its checkpoint's own chat template.

Runs in the orchestrator's stub. One request (the spec's system prompt, the earlier
turns, the user's media and text) becomes the messages of a chat, and the thinker
tokenizer's `apply_chat_template` renders them, as transformers does for the
omni models: each audio, image or video part becomes bos + one placeholder + eos, which the
llm stage expands to as many tokens as the encoder returned rows. The messages of
turn N extend those of turn N-1 and its reply, so with a ChatML template (the Qwen
family's) turn N's prompt extends turn N-1's prompt + reply and the engine's prefix
cache holds the conversation so far.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from omni_serve.orchestrator.request import Turn

Media = Literal["audio", "image", "video"]
# Files beside the tokenizer that hold the template when tokenizer_config.json does not
# (a processor's template, as the hub's omni checkpoints ship it).
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class Tokenizer(Protocol):
    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def messages(system: str, user: str, media: Sequence[Media] = (),
             history: Sequence[Turn] = ()) -> list[dict[str, Any]]:
    """The chat of one request: system (none when empty: the template's own default),
    the earlier turns (a turn with audio as its parts in order, each audio part one
    placeholder), then the user's media and text (a plain string when there is no
    media, which every chat template reads; none when the turn is media alone)."""
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    chat += [{"role": turn.role, "content": _content(turn.content)} for turn in history]
    if media:
        content: Any = [{"type": kind} for kind in media]
        if user:
            content.append({"type": "text", "text": user})
    else:
        content = user
    chat.append({"role": "user", "content": content})
    return chat


def _content(content: str | Sequence[tuple[str, Any]]) -> Any:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": value} if kind == "text" else {"type": kind}
            for kind, value in content]


class ChatPrompt:
    """Renders and tokenizes the thinker's prompts with its tokenizer."""

    def __init__(self, tokenizer: Tokenizer, source: str = "the tokenizer"):
        if not tokenizer.chat_template:
            raise ValueError(f"{source} has no chat template (tokenizer_config.json or "
                             f"{' / '.join(TEMPLATE_FILES)}): the thinker's prompt is "
                             "rendered with it")
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, folder: str | Path) -> ChatPrompt:
        """The tokenizer of a checkpoint folder, with the template beside it if its
        tokenizer_config.json has none."""
        import json

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        if not tokenizer.chat_template:
            for name in TEMPLATE_FILES:
                path = Path(folder) / name
                if path.is_file():
                    text = path.read_text()
                    tokenizer.chat_template = (json.loads(text)["chat_template"]
                                               if name.endswith(".json") else text)
                    break
        return cls(tokenizer, source=f"tokenizer folder {folder}")

    def render(self, system: str, user: str, media: Sequence[Media] = (),
               history: Sequence[Turn] = ()) -> str:
        """The prompt text, ending with the assistant's turn opened."""
        return self.tokenizer.apply_chat_template(
            messages(system, user, media, history), tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, without special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))
