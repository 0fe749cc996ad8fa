"""Media URLs of chat content parts that are no data: URL: local files and remote fetches.

Runs in the omni-openai process, on its event loop. A `video_url` part's URL is one of:
- a data: URL (base64): always taken (protocol.py decodes it, no I/O);
- `file://PATH`: read only when omni-openai was started with `--allowed-local-media-path
  DIR` and PATH resolves inside DIR (vLLM's OpenAI server's rule and flag);
- `http://` or `https://`: fetched only with `--allow-remote-media`, at most
  `--max-media-bytes` bytes and within `--media-fetch-timeout` seconds.
Anything else, or one of these not allowed, is a 400 naming the part's `url`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from omni_client.openai_server.protocol import OpenAIError

DEFAULT_MAX_MEDIA_BYTES = 16 * 2**20  # the orchestrator's own default max_media_bytes
DEFAULT_FETCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MediaURLSettings:
    """Which media URLs omni-openai reads (the default: data: URLs only)."""

    allowed_local_media_path: Path | None = None
    allow_remote_media: bool = False
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        folder = self.allowed_local_media_path
        if folder is not None:
            resolved = Path(folder).resolve()
            if not resolved.is_dir():
                raise ValueError(f"--allowed-local-media-path {os.fspath(folder)!r} is not a "
                                 "directory")
            object.__setattr__(self, "allowed_local_media_path", resolved)
        if self.max_media_bytes < 1:
            raise ValueError(f"--max-media-bytes must be >= 1, got {self.max_media_bytes}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"--media-fetch-timeout must be > 0, got {self.fetch_timeout_s}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MediaURLSettings:
        folder = args.allowed_local_media_path
        return cls(allowed_local_media_path=Path(folder) if folder else None,
                   allow_remote_media=args.allow_remote_media,
                   max_media_bytes=args.max_media_bytes,
                   fetch_timeout_s=args.media_fetch_timeout)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """omni-openai's media URL flags."""
    group = parser.add_argument_group("media URLs (video_url parts; data: URLs are always read)")
    group.add_argument("--allowed-local-media-path", metavar="DIR", default=None,
                       help="read file:// URLs inside DIR (as vLLM's OpenAI server; default: "
                            "no local files)")
    group.add_argument("--allow-remote-media", action="store_true",
                       help="fetch http(s):// URLs (default: refused with a 400)")
    group.add_argument("--max-media-bytes", type=int, default=DEFAULT_MAX_MEDIA_BYTES,
                       metavar="N", help="largest file read or fetched (default: %(default)s)")
    group.add_argument("--media-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT_S,
                       metavar="S", help="seconds a remote fetch may take (default: %(default)s)")


async def read_media_url(url: str, param: str, settings: MediaURLSettings) -> bytes:
    """The bytes a file:// or http(s):// media URL names, as `settings` allow.

    Raises:
        OpenAIError: 400 naming `param`: a scheme that is not allowed, a file outside the
            allowed directory or unreadable, a fetch that fails, or more than
            `max_media_bytes` bytes.
    """
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "file":
        return await asyncio.to_thread(_read_file, url, param, settings)
    if scheme in ("http", "https"):
        if not settings.allow_remote_media:
            raise OpenAIError(400, "remote media URLs are not fetched by this server (start "
                                   "omni-openai with --allow-remote-media); send a data: URL",
                              param=param)
        return await asyncio.to_thread(_fetch, url, param, settings)
    raise OpenAIError(400, f"unsupported URL scheme {scheme or url[:16]!r}: use a data: URL "
                           "(base64), file:// or http(s)://", param=param)


def _read_file(url: str, param: str, settings: MediaURLSettings) -> bytes:
    folder = settings.allowed_local_media_path
    if folder is None:
        raise OpenAIError(400, "local files are not read by this server (start omni-openai "
                               "with --allowed-local-media-path DIR); send a data: URL",
                          param=param)
    parts = urllib.parse.urlsplit(url)
    path = Path(urllib.request.url2pathname(parts.netloc + parts.path)).resolve()
    if folder not in path.parents:
        raise OpenAIError(400, f"the file {os.fspath(path)!r} is not inside the allowed "
                               f"directory --allowed-local-media-path {os.fspath(folder)!r}",
                          param=param)
    try:
        size = path.stat().st_size
        if size > settings.max_media_bytes:
            raise OpenAIError(400, f"the file is {size} bytes; at most {settings.max_media_bytes} "
                                   "are read (--max-media-bytes)", param=param)
        return path.read_bytes()
    except OSError as exc:
        raise OpenAIError(400, f"cannot read {os.fspath(path)!r}: {exc.strerror}",
                          param=param) from None


def _fetch(url: str, param: str, settings: MediaURLSettings) -> bytes:
    limit = settings.max_media_bytes
    try:
        with urllib.request.urlopen(url, timeout=settings.fetch_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise OpenAIError(400, f"the URL's content is {declared} bytes; at most {limit} "
                                       "are fetched (--max-media-bytes)", param=param)
            data = response.read(limit + 1)
    except urllib.error.HTTPError as exc:
        raise OpenAIError(400, f"fetching the URL got HTTP {exc.code}", param=param) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise OpenAIError(400, f"fetching the URL failed: {exc}", param=param) from None
    if len(data) > limit:
        raise OpenAIError(400, f"the URL's content is over {limit} bytes, the most fetched "
                               "(--max-media-bytes)", param=param)
    return data
