"""What an image or audio entry's header says, read without decoding the content.

The gateway checks what ``context_append`` is given against what a worker decodes
(shared/model/media.py): content that could never be read would otherwise be stored, and
every later ``generate`` or ``score`` on that context would fail on it. Only headers are read
here (Pillow's ``Image.open`` without ``load``, the WAV chunk list), so the check costs about
what parsing the request did; content whose header is sound but whose data is broken is
still refused by the worker, which names the entry. No torch here: the gateway imports it.
"""

from __future__ import annotations

import io
import warnings
import wave


class MediaError(ValueError):
    """Image/audio content that cannot be decoded or is too large."""


WAV_SAMPLE_WIDTHS = (1, 2, 4)  # bytes per sample a worker reads (8/16/32-bit PCM)


def check_image_header(data: bytes, *, max_pixels: int) -> None:
    """Raise :class:`MediaError` unless ``data`` starts as an image Pillow reads, of at most
    ``max_pixels`` pixels. Without Pillow any bytes pass: a worker reads them as raw patches."""
    if not data:
        raise MediaError("image is empty")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - exercised only without Pillow
        return
    try:
        with warnings.catch_warnings():  # the pixel limit is ours, checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
    except Image.DecompressionBombError:
        raise MediaError(f"image is larger than {max_pixels} pixels (model.max_image_pixels)") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise MediaError(f"image format not recognised ({type(exc).__name__}): give an image Pillow reads "
                         "(PNG, JPEG, GIF, WebP, BMP, ...)") from None
    if w * h > max_pixels:
        raise MediaError(f"image is {w}x{h} pixels; at most {max_pixels} pixels are accepted (model.max_image_pixels)")


def is_wav(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WAVE"


def check_audio_header(data: bytes) -> None:
    """Raise :class:`MediaError` unless ``data`` is a WAV file whose header a worker reads (PCM of
    a sample width it takes, with samples) or raw 16-bit PCM (at least one sample)."""
    if not data:
        raise MediaError("audio is empty")
    if not is_wav(data):
        if len(data) < 2:
            raise MediaError("raw audio must be 16-bit little-endian PCM")
        return
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, frames = w.getsampwidth(), w.getnframes()
    except (wave.Error, EOFError, ValueError) as exc:
        raise MediaError(f"audio is not a valid WAV file ({str(exc) or 'its header is cut short'})") from None
    if width not in WAV_SAMPLE_WIDTHS:
        raise MediaError(f"WAV sample width {width} bytes is not supported (1, 2 or 4)")
    if frames == 0:
        raise MediaError("audio has no samples")


def check_media_header(modality: str, data: bytes, *, max_image_pixels: int) -> None:
    """:func:`check_image_header` or :func:`check_audio_header` by channel; other channels pass."""
    if modality == "image":
        check_image_header(data, max_pixels=max_image_pixels)
    elif modality == "audio":
        check_audio_header(data)
