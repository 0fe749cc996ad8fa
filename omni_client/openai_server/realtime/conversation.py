"""A realtime session's conversation: its items, and the chat they make for a response.

Runs in the omni-openai process, with no I/O. Items come from the client
(`conversation.item.create`, a committed audio buffer) and from responses (the
assistant's reply, as far as it was sent). A response runs the whole
conversation: the last item is the user's new turn (its text and its audio),
the items before it are the history, an earlier audio turn with its audio (as
the omni entry model's history audio parts), so the thinker hears every turn and
each turn's prompt extends the one before.

A response sends at most `max_audio` audio turns (the omni model hears each one
again). Past that, with truncation on (OpenAI's `truncation: auto`), the oldest
turns are left out until half of the limit is left, and later responses start
from the same item until the limit is reached again, so their prompts still
extend each other (the thinker's prefix cache hits) between cuts.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_client.openai_server.realtime import audio as wire
from omni_client.openai_server.realtime.client_events import ItemIn, RealtimeError
from omni_client.openai_server.realtime.server_events import new_id

Role = Literal["user", "assistant", "system"]
PART_TYPES = {"user": ("input_text", "input_audio"), "system": ("input_text",),
              "assistant": ("output_text", "output_audio", "text")}


@dataclass
class Item:
    """One message of the conversation.

    Attributes:
        parts: ("text", str) or ("audio", PCM16 24 kHz bytes) in order; an
            assistant's reply is one ("text", its transcript or text) part.
        spoken: an assistant reply in audio (its text is the transcript).
    """

    role: Role
    parts: list[tuple[str, Any]] = field(default_factory=list)
    id: str = field(default_factory=lambda: new_id("item"))
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    spoken: bool = False

    @property
    def text(self) -> str:
        return "".join(value for kind, value in self.parts if kind == "text")

    @property
    def audio(self) -> bytes | None:
        return next((value for kind, value in self.parts if kind == "audio"), None)

    def openai(self) -> dict[str, Any]:
        """The item as OpenAI's conversation item (input audio is not echoed back)."""
        if self.role == "assistant":
            content = [{"type": "output_audio", "transcript": self.text} if self.spoken
                       else {"type": "output_text", "text": self.text}]
        else:
            content = [{"type": "input_text", "text": value} if kind == "text"
                       else {"type": "input_audio", "transcript": None}
                       for kind, value in self.parts]
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": content}


def item_from_client(item: ItemIn, max_audio_bytes: int) -> Item:
    """The Item a `conversation.item.create` adds.

    Raises:
        RealtimeError: a content part that its role does not take, or that
            lacks its field; input audio that is not base64 PCM16, over the
            buffer limit, or more than one in a message.
    """
    out = Item(item.role, id=item.id or new_id("item"))
    for i, part in enumerate(item.content):
        param = f"item.content[{i}]"
        if part.type not in PART_TYPES[item.role]:
            raise RealtimeError(f"a {item.role} item takes content of type "
                                f"{' or '.join(PART_TYPES[item.role])}, got {part.type!r}",
                                param=f"{param}.type", code="invalid_value")
        if part.type == "input_audio":
            out.parts.append(("audio", _input_audio(part.audio, param, max_audio_bytes)))
            if sum(kind == "audio" for kind, _ in out.parts) > 1:
                raise RealtimeError("at most one input_audio part per item", param=param,
                                    code="invalid_value")
            continue
        value = part.transcript if part.type == "output_audio" else part.text
        if value is None:
            name = "transcript" if part.type == "output_audio" else "text"
            raise RealtimeError(f"a {part.type} part needs its {name}", param=f"{param}.{name}",
                                code="missing_required_parameter")
        out.parts.append(("text", value))
        out.spoken = out.spoken or part.type == "output_audio"
    return out


def _input_audio(data: str | None, param: str, max_bytes: int) -> bytes:
    if data is None:
        raise RealtimeError("an input_audio part needs its audio (base64 PCM16 at 24 kHz)",
                            param=f"{param}.audio", code="missing_required_parameter")
    try:
        pcm = wire.decode_pcm16(data)
    except wire.AudioDecodeError as exc:
        raise RealtimeError(str(exc), param=f"{param}.audio", code="invalid_value") from None
    if len(pcm) > max_bytes:
        raise RealtimeError(f"the audio is {len(pcm)} bytes; at most {max_bytes} are allowed "
                            "(--realtime-max-buffer-bytes)", param=f"{param}.audio",
                            code="input_audio_buffer_full")
    return pcm


@dataclass(frozen=True)
class Turn:
    """What one response sends to the pipeline."""

    text: str
    audio_wav: bytes | None
    # [{"role", "content"}]: a string, or an audio turn's parts (omni `history`)
    history: list[dict[str, Any]]

    @property
    def has_audio(self) -> bool:
        """Whether the model must hear audio (this turn's or an earlier one's)."""
        return self.audio_wav is not None or any(
            not isinstance(turn["content"], str) for turn in self.history)


class Conversation:
    """The items of one session, in order."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self._start: str | None = None  # the first item responses send (None: the first one)

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert `item` after `previous_item_id` ("root": first; None: last); returns the
        id of the item before it.

        Raises:
            RealtimeError: the previous item or the item's id is unknown / taken.
        """
        if any(it.id == item.id for it in self.items):
            raise RealtimeError(f"an item with id {item.id!r} exists", param="item.id",
                                code="invalid_value")
        if previous_item_id is None:
            index = len(self.items)
        elif previous_item_id == "root":
            index = 0
        else:
            ids = [it.id for it in self.items]
            if previous_item_id not in ids:
                raise RealtimeError(f"no item with id {previous_item_id!r}",
                                    param="previous_item_id", code="invalid_value")
            index = ids.index(previous_item_id) + 1
        self.items.insert(index, item)
        return self.items[index - 1].id if index else None

    def turn(self, *, audio_prompt: str, system: str | None, max_audio: int = 16,
             truncate: bool = True) -> Turn:
        """The new user turn and the history before it (with `system` first, if given), at
        most `max_audio` of them audio turns (module docstring).

        Raises:
            RealtimeError: the conversation does not end with a user item, or it has more
                audio turns than `max_audio` and `truncate` is off.
        """
        if not self.items or self.items[-1].role != "user":
            raise RealtimeError("a response answers the user: add a user item (or commit the "
                                "input audio buffer) first", param="response",
                                code="conversation_has_no_user_turn")
        before = self._window(max_audio, truncate)
        last = self.items[-1]
        history = [{"role": "system", "content": system}] if system else []
        for item in before:
            content = _history_content(item, audio_prompt)
            if content:  # a reply cancelled before its first word says nothing
                history.append({"role": item.role, "content": content})
        audio = last.audio
        return Turn(text=last.text or audio_prompt,
                    audio_wav=None if audio is None else wire.input_wav(audio), history=history)

    def _window(self, max_audio: int, truncate: bool) -> list[Item]:
        """The items before the last one that this response sends."""
        ids = [it.id for it in self.items]
        start = ids.index(self._start) if self._start in ids else 0
        window = self.items[start:-1]
        heard = _audio_turns(self.items[start:])  # the window's and the new turn's
        if heard <= max_audio:
            return window
        if not truncate:
            raise RealtimeError(f"this response would send {heard} audio turns; at most "
                                f"{max_audio} are allowed (omni-openai --realtime-max-audio-turns)"
                                "; with session.truncation 'auto' the oldest turns are left out",
                                param="session.truncation", code="invalid_value")
        keep = max(1, max_audio // 2)
        while window and (heard > keep or window[0].role != "user"):
            heard -= window.pop(0).audio is not None
        self._start = window[0].id if window else self.items[-1].id
        return window


def _audio_turns(items: list[Item]) -> int:
    return sum(it.audio is not None for it in items)


def _history_content(item: Item, audio_prompt: str) -> str | list[dict[str, str]]:
    """An earlier item as a history turn's content: its text, or for an audio turn its
    audio and then its text (the audio prompt when it had none), as the turn's own
    request sent them, so its prompt is the same tokens."""
    if item.audio is None:
        return item.text
    wav = base64.b64encode(wire.input_wav(item.audio)).decode("ascii")
    text = item.text or audio_prompt
    return [{"type": "audio", "audio": wav}, *([{"type": "text", "text": text}] if text else [])]
