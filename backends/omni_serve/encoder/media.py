"""Media bytes -> decoded, validated media (runs inside the omni_encoder Triton stub and in tests).

Flow: one request's encoded `media` bytes -> a PIL RGB image (image encoder)
or float32 mono samples at the tower's rate (audio encoder). Every bad input
raises `RequestError("media", ...)` naming what is allowed, so the adapter
answers that request alone with INVALID_ARG. Cheap checks come first: size,
then the container header (image width/height, audio frames/rate), and
only then the pixels or samples are decoded.
"""
from __future__ import annotations

import io
import math
import re

import numpy as np
from PIL import Image, UnidentifiedImageError

from omni_serve.encoder.config import MediaLimits
from omni_serve.errors import RequestError

FIELD = "media"
# Qwen2-VL's smart_resize refuses images whose long side is over 200x the short side.
MAX_ASPECT_RATIO = 200
IMAGE_FORMATS = "PNG, JPEG, WebP, GIF, BMP, TIFF"
AUDIO_FORMATS = "WAV, FLAC, OGG/Vorbis, MP3, AIFF"


def _check_size(data: bytes, cfg: MediaLimits, what: str) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RequestError(FIELD, f"expected the bytes of an encoded {what}, got {type(data).__name__}")
    if len(data) == 0:
        raise RequestError(FIELD, f"empty media: send the bytes of an encoded {what}")
    if len(data) > cfg.max_media_bytes:
        raise RequestError(FIELD, f"media is {len(data)} bytes; this encoder accepts at most "
                                  f"{cfg.max_media_bytes} bytes")


# --- images -------------------------------------------------------------------------


def _check_image_size(width: int, height: int, cfg: MediaLimits) -> None:
    lo, hi = cfg.min_image_side, cfg.max_image_side
    if not (lo <= width <= hi and lo <= height <= hi):
        raise RequestError(FIELD, f"image is {width}x{height}; width and height must be between "
                                  f"{lo} and {hi} pixels")
    if width * height > cfg.max_image_pixels:
        raise RequestError(FIELD, f"image is {width}x{height} = {width * height} pixels; the limit is "
                                  f"{cfg.max_image_pixels} pixels")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise RequestError(FIELD, f"image is {width}x{height}; the long side may be at most "
                                  f"{MAX_ASPECT_RATIO}x the short side")


def decode_image(data: bytes, cfg: MediaLimits) -> Image.Image:
    """The RGB image in `data` (any format Pillow reads; the first frame of an animation).

    The header's size is checked against the limits before any pixel is decoded.
    Raises RequestError("media", ...) for empty/oversized input, bytes that are
    not an image, a corrupt or truncated file, or a size beyond the limits.
    """
    _check_size(data, cfg, "image")
    try:
        image = Image.open(io.BytesIO(bytes(data)))
    except Image.DecompressionBombError as e:
        raise RequestError(FIELD, f"image is too large to decode ({e}); the limit is "
                                  f"{cfg.max_image_pixels} pixels") from e
    except UnidentifiedImageError as e:
        raise RequestError(FIELD, f"not a decodable image; send an encoded image file "
                                  f"({IMAGE_FORMATS})") from e
    except Exception as e:  # malformed headers raise OSError, SyntaxError, ValueError, ...
        raise RequestError(FIELD, f"corrupt or truncated image header ({type(e).__name__}: {e}); "
                                  f"send a complete image file ({IMAGE_FORMATS})") from e
    width, height = image.size
    _check_image_size(width, height, cfg)
    try:
        image.load()
        # The processor's own conversion (transformers' convert_to_rgb), done here.
        return image if image.mode == "RGB" else image.convert("RGB")
    except Image.DecompressionBombError as e:
        raise RequestError(FIELD, f"image is too large to decode ({e})") from e
    except Exception as e:  # truncated data: OSError; broken streams: SyntaxError, ValueError, ...
        raise RequestError(FIELD, f"corrupt or truncated {image.format or ''} image "
                                  f"({type(e).__name__}: {e}); send a complete image file") from e


# --- audio --------------------------------------------------------------------------


def _open_audio(data: bytes):
    import soundfile as sf

    try:
        return sf.SoundFile(io.BytesIO(bytes(data)))
    except Exception as e:  # sf.LibsndfileError (a RuntimeError), TypeError, ...
        raise RequestError(FIELD, f"not a decodable audio file; send an encoded audio file "
                                  f"({AUDIO_FORMATS})") from e


# libsndfile's parse log names a data chunk longer than the file: "data : 9600 (should be 2956)"
_SHORT_DATA = re.compile(r"^data\s*:\s*(\d+) \(should be (\d+)\)", re.MULTILINE)


def _check_complete(f, rate: int) -> None:
    """A file whose header announces more samples than it holds (a cut-off upload) is
    refused: libsndfile would decode the part that is there without a word."""
    found = _SHORT_DATA.search(f.extra_info or "")
    if found is None:
        return
    announced, held = int(found.group(1)), int(found.group(2))
    if 0 < held < announced < 0xFFFFFFFF:  # 0 and 0xFFFFFFFF: "length unknown", streamed
        per_second = max(1, rate * f.channels * max(1, _sample_bytes(f.subtype)))
        raise RequestError(FIELD, f"truncated audio file: its header announces {announced} bytes "
                                  f"of samples ({announced / per_second:.2f} s), the file holds "
                                  f"{held}; send the complete file")


def _sample_bytes(subtype: str) -> int:
    digits = "".join(c for c in subtype if c.isdigit())
    return {"FLOAT": 4, "DOUBLE": 8}.get(subtype, int(digits) // 8 if digits else 1)


def _resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return samples
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return resample_poly(samples, target // g, rate // g).astype(np.float32, copy=False)


def decode_audio(data: bytes, cfg: MediaLimits) -> np.ndarray:
    """Float32 mono samples of the audio file in `data`, resampled to `cfg.sample_rate`.

    Multi-channel audio is averaged to mono; other rates are resampled with a
    polyphase filter (scipy.signal.resample_poly). The duration in the header
    is checked before samples are decoded. Raises RequestError("media", ...)
    for empty/oversized input, bytes that are not audio, a corrupt or truncated file, no
    samples, audio longer than `cfg.max_audio_seconds`, or NaN/inf samples.
    """
    _check_size(data, cfg, "audio file")
    with _open_audio(data) as f:
        rate, frames = int(f.samplerate), int(f.frames)
        if rate <= 0:
            raise RequestError(FIELD, f"audio header has an invalid sample rate ({rate})")
        _check_complete(f, rate)
        # libsndfile reports frames=-1 (unknown) for some streams; check again after decoding.
        if frames > cfg.max_audio_seconds * rate:
            raise RequestError(FIELD, f"audio is {frames / rate:.2f} s long; this encoder accepts at "
                                      f"most {cfg.max_audio_seconds:g} s")
        try:
            samples = f.read(dtype="float32", always_2d=True)
        except Exception as e:
            raise RequestError(FIELD, f"corrupt or truncated audio file ({type(e).__name__}: {e}); "
                                      f"send a complete audio file ({AUDIO_FORMATS})") from e
    if samples.shape[0] == 0:
        raise RequestError(FIELD, "audio has no samples (zero length); send at least a few "
                                  "milliseconds of sound")
    if samples.shape[0] > cfg.max_audio_seconds * rate:
        raise RequestError(FIELD, f"audio is {samples.shape[0] / rate:.2f} s long; this encoder "
                                  f"accepts at most {cfg.max_audio_seconds:g} s")
    if not np.isfinite(samples).all():
        raise RequestError(FIELD, "audio has NaN or infinite samples; send finite PCM samples")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    return np.ascontiguousarray(_resample(mono, rate, cfg.sample_rate), dtype=np.float32)
