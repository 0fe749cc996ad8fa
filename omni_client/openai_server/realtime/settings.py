"""The limits and defaults of omni-openai's realtime sessions, and their CLI flags.

Runs in the omni-openai process at start-up: `add_arguments` adds the flags to
omni-openai's parser, `RealtimeSettings.from_args` reads them back.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RealtimeSettings:
    """Limits of `/v1/realtime`.

    Attributes:
        max_sessions: sessions open at once; one more is refused (an error
            event, then the socket closes).
        max_buffer_bytes: bytes the input audio buffer (and one input_audio
            item) may hold, PCM16 at 24 kHz (the default is 10 minutes).
        idle_timeout_s: a session with no client event and no running
            response for this long is closed.
        max_session_s: a session is closed this long after it opened.
        audio_prompt: the text sent with a user turn that is audio only (empty, the
            default: the turn is the audio alone, as the model's processor takes it).
            An earlier audio turn reaches the model in the history as its audio and
            the same text, so the later turn's prompt extends its prompt.
        max_audio_turns: audio turns one response sends, the new one and the earlier
            ones the model hears again; the omni model's `max_audio_items` (16 in the
            presets) must allow as many. Past it, a session with `truncation: auto`
            (the default, as OpenAI's) leaves out its oldest turns; with `disabled`
            the response fails with an error naming this limit.
    """

    max_sessions: int = 32
    max_buffer_bytes: int = 24000 * 2 * 600
    idle_timeout_s: float = 300.0
    max_session_s: float = 3600.0
    audio_prompt: str = ""
    max_audio_turns: int = 16

    def __post_init__(self):
        for name in ("max_sessions", "max_buffer_bytes", "idle_timeout_s", "max_session_s",
                     "max_audio_turns"):
            if getattr(self, name) <= 0:
                raise ValueError(f"realtime {name} must be positive, got {getattr(self, name)!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RealtimeSettings:
        return cls(**{f.name: getattr(args, f"realtime_{f.name}") for f in fields(cls)})


_HELP = {
    "max_sessions": "realtime sessions open at once (default: %(default)s)",
    "max_buffer_bytes": "bytes of PCM16 24 kHz input audio a session buffers (default: "
                        "%(default)s, 10 minutes)",
    "idle_timeout_s": "seconds without a client event before a session closes "
                      "(default: %(default)s)",
    "max_session_s": "seconds a session may last (default: %(default)s)",
    "audio_prompt": "text sent with a user turn that is audio only (default: none, the "
                    "audio alone)",
    "max_audio_turns": "audio turns one response sends, earlier ones included; at most the "
                       "omni model's max_audio_items (default: %(default)s)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--realtime-max-sessions`, `--realtime-max-buffer-bytes`, `--realtime-idle-timeout-s`,
    `--realtime-max-session-s`, `--realtime-audio-prompt` and `--realtime-max-audio-turns`."""
    defaults = RealtimeSettings()
    for f in fields(RealtimeSettings):
        default = getattr(defaults, f.name)
        parser.add_argument(f"--realtime-{f.name.replace('_', '-')}", type=type(default),
                            default=default, help=_HELP[f.name])
