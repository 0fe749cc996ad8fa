"""omni-client: the command line of the omni_client SDK.

    omni-client chat "Describe this" --image cat.png --audio-out reply.wav
    omni-client image "a red fox in the snow" -o fox.png --size 512x512 --seed 7
    omni-client speech "Hello there" -o hello.flac --voice Chelsie
    omni-client models

Runs in the caller's process; a thin layer over `OmniClient` (the SDK does the
work): argument parsing, writing files, progress on stderr. Streamed text goes
to stdout as it arrives; progress and the closing summary go to stderr (the
progress line is redrawn in place only on a terminal, and for `chat` only
while stdout is not that terminal too, so it never cuts into the text).

Exit status: 0 done, 2 bad request (the client or the server rejected the
arguments), 3 server or model unavailable, 1 any other failure; errors are one
"error: <message>" line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from PIL import Image

from omni_client.client import OmniClient
from omni_client.errors import BadRequestError, OmniClientError, UnavailableError
from omni_client.media import AUDIO_FORMATS, audio_format, write_audio
from omni_client.types import AudioChunk, ChatResult, Event, ImageOutput, TextDelta
from omni_serve import env

DEFAULT_URL = "localhost:8001"
EXIT_OK, EXIT_ERROR, EXIT_BAD_REQUEST, EXIT_UNAVAILABLE = 0, 1, 2, 3
TICK_S = 0.5


# --- arguments -------------------------------------------------------------------------

def _size(value: str) -> tuple[int, int]:
    width, sep, height = value.lower().partition("x")
    try:
        size = int(width), int(height)
    except ValueError:
        size = (0, 0)
    if not sep or min(size) <= 0:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, e.g. 512x512, got {value!r}")
    return size


def _positive(kind: type) -> Any:
    def parse(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            number = 0
        if not number > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
        return number
    return parse


def build_parser() -> argparse.ArgumentParser:
    # The global options are accepted before and after the subcommand: the
    # subcommands' copies default to SUPPRESS so they only override when given.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help=f"Triton gRPC endpoint host:port (default: $OMNI_URL or {DEFAULT_URL})")
    common.add_argument("--timeout", type=_positive(float), default=argparse.SUPPRESS, metavar="S",
                        help="seconds to wait for each response (default: 60)")
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no progress or summary on stderr")

    parser = argparse.ArgumentParser(
        prog="omni-client", description="Call omni pipelines served by Triton (chat, images, speech).",
        epilog="Exit status: 0 ok, 2 bad request, 3 server or model unavailable, 1 other errors.")
    parser.add_argument("--url", default=env.URL.get() or DEFAULT_URL,
                        help=f"Triton gRPC endpoint host:port (default: $OMNI_URL or {DEFAULT_URL})")
    parser.add_argument("--timeout", type=_positive(float), default=None, metavar="S",
                        help="seconds to wait for each response (default: 60)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress or summary on stderr")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    chat = commands.add_parser("chat", parents=[common], help="chat; the reply streams to stdout",
                               description="Send a message (with an image, audio or a video) and stream "
                                           "the reply to stdout; --audio-out also asks for speech.")
    chat.add_argument("text", help="the message")
    chat.add_argument("--image", metavar="PATH", help="an image to send with the message")
    chat.add_argument("--audio", metavar="PATH", help="an audio file (WAV, FLAC, OGG) to send")
    chat.add_argument("--video", metavar="PATH", help="a video file (MP4, MOV, MKV, WebM, AVI) to send")
    chat.add_argument("--use-audio-in-video", action=argparse.BooleanOptionalAction, default=None,
                      help="with --video: hear its soundtrack with its frames (default: the "
                           "checkpoint's processor default, off for the Qwen omni models)")
    chat.add_argument("--audio-out", metavar="PATH",
                      help="also speak the reply and write it here (.wav, .flac or .pcm)")
    chat.add_argument("--image-out", metavar="PATH", help="also generate an image and write it here")
    chat.add_argument("--model", help="entry model (default: the server's omni pipeline, else llm)")
    chat.add_argument("--max-tokens", type=_positive(int), metavar="N", help="reply length limit in tokens")
    chat.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (0: greedy)")
    chat.add_argument("--voice", help="voice of the spoken reply")
    chat.add_argument("--seed", type=int, help="seed of the audio and image generators")
    chat.set_defaults(run=run_chat)

    image = commands.add_parser("image", parents=[common], help="generate an image",
                                description="Generate one image with a DiT model.")
    image.add_argument("prompt", help="what to draw")
    image.add_argument("-o", "--output", required=True, metavar="PATH",
                       help="where to write it (.png; other suffixes PIL knows are converted)")
    image.add_argument("--size", type=_size, metavar="WxH", help="width x height in pixels")
    image.add_argument("--steps", type=_positive(int), metavar="N", help="denoising steps")
    image.add_argument("--guidance-scale", type=float, help="classifier-free guidance scale")
    image.add_argument("--seed", type=int, help="seed (the same seed gives the same image)")
    image.add_argument("--negative-prompt", help="what not to draw")
    image.add_argument("--model", help="DiT model (default: the server's first)")
    image.set_defaults(run=run_image)

    speech = commands.add_parser("speech", parents=[common], help="read text aloud",
                                 description="Read text aloud with an omni pipeline's talker.")
    speech.add_argument("text", help="what to say")
    speech.add_argument("-o", "--output", required=True, metavar="PATH", help="audio file to write")
    speech.add_argument("--voice", help="voice (default: the pipeline's)")
    speech.add_argument("--format", choices=AUDIO_FORMATS,
                        help="audio format (default: from the output's suffix)")
    speech.add_argument("--seed", type=int, help="seed of the audio generator")
    speech.add_argument("--model", help="omni pipeline (default: the server's first)")
    speech.set_defaults(run=run_speech)

    models = commands.add_parser("models", parents=[common], help="list the entry models",
                                 description="List the server's entry models.")
    models.add_argument("--all", action="store_true",
                        help="also list the models that only serve a pipeline (e.g. a talker)")
    models.set_defaults(run=run_models)
    return parser


# --- output files --------------------------------------------------------------------------

def _check_image_path(path: str, option: str) -> None:
    suffix = Path(path).suffix.lower()
    if suffix and suffix not in Image.registered_extensions():
        raise BadRequestError(f"{option}: unknown image suffix {suffix!r} in {path!r}; use .png")


def write_image(path: str, image: ImageOutput) -> None:
    """Write the PNG as it came, or converted when the suffix asks for another format."""
    if Path(path).suffix.lower() in ("", ".png"):
        Path(path).write_bytes(image.png)
        return
    picture = image.to_pil()
    if Path(path).suffix.lower() in (".jpg", ".jpeg"):
        picture = picture.convert("RGB")
    picture.save(path)


# --- progress on stderr ----------------------------------------------------------------------

class Progress:
    """Status on stderr: one line redrawn in place (`live`), then a summary line."""

    def __init__(self, stream: TextIO, *, live: bool, quiet: bool = False) -> None:
        self.stream = stream
        self.live = live and not quiet
        self.quiet = quiet
        self._drawn = False
        self._lock = threading.Lock()

    def update(self, line: str) -> None:
        if not self.live:
            return
        with self._lock:
            self.stream.write(f"\r\033[K{line}")
            self.stream.flush()
            self._drawn = True

    def clear(self) -> None:
        with self._lock:
            if self._drawn:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self._drawn = False

    def done(self, line: str) -> None:
        self.clear()
        if not self.quiet:
            self.stream.write(line + "\n")
            self.stream.flush()


class Ticker:
    """A thread redrawing "<label> 1.5 s" every TICK_S while a call waits (live progress only)."""

    def __init__(self, progress: Progress, label: str) -> None:
        self.progress = progress
        self.label = label
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-client-ticker", daemon=True)

    def __enter__(self) -> Ticker:
        if self.progress.live:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.progress.clear()

    def _run(self) -> None:
        while True:
            self.progress.update(f"{self.label} {time.monotonic() - self.started:.1f} s")
            if self._stop.wait(TICK_S):
                return


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def chat_summary(result: ChatResult, *, first_token_s: float | None, total_s: float) -> str:
    parts = []
    if first_token_s is not None:
        parts.append(f"first token {first_token_s:.2f} s")
    parts.append(f"total {total_s:.2f} s")
    if result.audio is not None and result.sample_rate:
        parts.append(f"audio {result.audio.size / result.sample_rate:.2f} s")
    if result.images:
        parts.append(f"{len(result.images)} image{'s' * (len(result.images) > 1)}")
    if result.usage is not None:
        parts.append(f"tokens {result.usage.prompt_tokens} in / {result.usage.completion_tokens} out")
    if result.finish_reason:
        parts.append(f"finish {result.finish_reason}")
    return ", ".join(parts)


# --- commands ------------------------------------------------------------------------------

def run_chat(client: OmniClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    audio_fmt = None if args.audio_out is None else audio_format(args.audio_out,
                                                                 field="--audio-out")
    if args.image_out is not None:
        _check_image_path(args.image_out, "--image-out")
    modalities = None
    if args.audio_out is not None or args.image_out is not None:
        modalities = ["text"] + ["audio"] * (args.audio_out is not None) \
            + ["image"] * (args.image_out is not None)
    progress = Progress(err, live=_isatty(err) and not _isatty(out), quiet=args.quiet)
    started = time.monotonic()
    first_token_s: float | None = None
    audio_s = 0.0
    events: list[Event] = []
    stream = client.stream(args.text, model=args.model, image=args.image, audio=args.audio,
                           video=args.video, use_audio_in_video=args.use_audio_in_video,
                           modalities=modalities, max_tokens=args.max_tokens,
                           temperature=args.temperature, voice=args.voice, seed=args.seed)
    try:
        for event in stream:
            events.append(event)
            if isinstance(event, TextDelta) and event.text:
                if first_token_s is None:
                    first_token_s = time.monotonic() - started
                out.write(event.text)
                out.flush()
            elif isinstance(event, AudioChunk):
                audio_s += event.duration_s
                progress.update(f"audio: {audio_s:.1f} s received")
            elif isinstance(event, ImageOutput):
                progress.update("image received")
    except BaseException:
        if first_token_s is not None:  # end the partial reply's line before the error
            out.write("\n")
        raise
    else:
        out.write("\n")
    finally:
        stream.close()
        progress.clear()
        out.flush()
    result = ChatResult.from_events(events)
    total_s = time.monotonic() - started
    notes = []
    if args.audio_out is not None:
        if result.audio is None or result.sample_rate is None:
            raise OmniClientError("the reply came without audio")
        write_audio(args.audio_out, result.audio, result.sample_rate, audio_fmt)
        notes.append(f"wrote {args.audio_out}")
    if args.image_out is not None:
        if not result.images:
            raise OmniClientError("the reply came without an image")
        write_image(args.image_out, ImageOutput(result.images[-1]))
        notes.append(f"wrote {args.image_out}")
    progress.done("; ".join([chat_summary(result, first_token_s=first_token_s, total_s=total_s),
                             *notes]))


def run_image(client: OmniClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    _check_image_path(args.output, "--output")
    width, height = args.size or (None, None)
    progress = Progress(err, live=_isatty(err), quiet=args.quiet)
    started = time.monotonic()
    with Ticker(progress, "generating image:"):
        image = client.generate_image(args.prompt, model=args.model, width=width, height=height,
                                      steps=args.steps, guidance_scale=args.guidance_scale,
                                      negative_prompt=args.negative_prompt, seed=args.seed)
    elapsed = time.monotonic() - started
    write_image(args.output, image)
    size = "x".join(str(n) for n in image.to_pil().size)
    out.write(f"wrote {args.output} ({size}) in {elapsed:.2f} s\n")


def run_speech(client: OmniClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    fmt = audio_format(args.output, args.format, field="--output", fmt_option="--format")
    progress = Progress(err, live=_isatty(err), quiet=args.quiet)
    started = time.monotonic()
    with Ticker(progress, "speaking:"):
        speech = client.speech(args.text, model=args.model, voice=args.voice, seed=args.seed)
    elapsed = time.monotonic() - started
    write_audio(args.output, speech.samples, speech.sample_rate, fmt)
    out.write(f"wrote {args.output} ({speech.duration_s:.2f} s of audio at {speech.sample_rate} Hz, "
              f"{fmt}) in {elapsed:.2f} s\n")


def run_models(client: OmniClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    rows = [("NAME", "KIND", "BACKEND")]
    for model in client.list_models():
        internal = getattr(model, "internal", False)
        if args.all or not internal:
            rows.append((model.name, model.kind, model.backend + " (internal)" * internal))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, kind, backend in rows:
        out.write(f"{name:<{widths[0]}}  {kind:<{widths[1]}}  {backend}\n")


# --- entry point ---------------------------------------------------------------------------

def exit_code(exc: BaseException) -> int:
    if isinstance(exc, BadRequestError):
        return EXIT_BAD_REQUEST
    if isinstance(exc, UnavailableError):
        return EXIT_UNAVAILABLE
    return EXIT_ERROR


def _message(exc: BaseException) -> str:
    if isinstance(exc, OmniClientError):
        return exc.message
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc) or type(exc).__name__


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    args = build_parser().parse_args(argv)
    kwargs = {} if args.timeout is None else {"timeout": args.timeout}
    try:
        with OmniClient(args.url, **kwargs) as client:
            args.run(client, args, out, err)
    except KeyboardInterrupt:
        err.write("\ninterrupted\n")
        return 130
    except Exception as exc:  # every failure is one line, never a traceback
        err.write(f"error: {_message(exc)}\n")
        err.flush()
        return exit_code(exc)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
