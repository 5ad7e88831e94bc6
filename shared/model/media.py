"""Turn image and audio bytes into prefix feature vectors for the model.

Images: decoded with Pillow (PNG, JPEG, GIF, WebP, BMP ... whatever Pillow reads), converted
to RGB, resized to a fixed ``grid x grid`` patches of ``patch x patch`` pixels, and flattened
into ``grid*grid`` vectors of ``patch*patch*3`` values in [0, 1]. Images larger than
``max_pixels`` (checked from the header, before decoding) or that Pillow cannot decode raise
:class:`MediaError`. Without Pillow installed, image bytes are read as a raw patch stream:
consecutive ``patch*patch*3`` byte chunks (zero-padded), scaled to [0, 1], at most
``grid*grid`` of them evenly spaced over the content.

Audio: a RIFF/WAVE file (8/16/32-bit PCM, any channel count — mixed to mono) via the
standard ``wave`` module, or otherwise raw signed 16-bit little-endian mono PCM. Samples are
cut into frames of ``frame`` samples; at most ``max_frames`` frames, evenly spaced.
"""

from __future__ import annotations

import io
import wave

import numpy as np
import torch

from shared.media_check import MediaError, is_wav

try:  # optional: Pillow decodes real image formats
    from PIL import Image, UnidentifiedImageError
except ImportError:  # pragma: no cover - exercised only without Pillow
    Image = None  # type: ignore[assignment]
    UnidentifiedImageError = OSError  # type: ignore[assignment,misc]


def image_features(data: bytes, *, patch: int, grid: int, max_pixels: int) -> torch.Tensor:
    """Return ``[grid*grid, patch*patch*3]`` float32 features of an image."""
    if not data:
        raise MediaError("image is empty")
    if Image is None:
        return _raw_patches(data, patch * patch * 3, grid * grid)
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise MediaError(f"image is {w}x{h} pixels; at most {max_pixels} pixels are accepted")
            side = patch * grid
            rgb = im.convert("RGB").resize((side, side))
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise MediaError(f"image could not be decoded ({type(exc).__name__})") from None
    arr = np.asarray(rgb, dtype=np.float32) / 255.0  # [side, side, 3]
    arr = arr.reshape(grid, patch, grid, patch, 3).transpose(0, 2, 1, 3, 4).reshape(grid * grid, -1)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _raw_patches(data: bytes, dim: int, max_n: int) -> torch.Tensor:
    n = max(1, -(-len(data) // dim))
    buf = np.zeros(n * dim, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = buf.reshape(n, dim)
    if n > max_n:
        rows = rows[np.linspace(0, n - 1, max_n).round().astype(np.int64)]
    return torch.from_numpy(rows.astype(np.float32) / 255.0)


def audio_features(data: bytes, *, frame: int, max_frames: int) -> torch.Tensor:
    """Return ``[n_frames, frame]`` float32 features in [-1, 1] of an audio clip."""
    if not data:
        raise MediaError("audio is empty")
    if is_wav(data):
        samples = _wav_samples(data)
    else:
        if len(data) % 2:
            data = data[:-1]
        if not data:
            raise MediaError("raw audio must be 16-bit little-endian PCM")
        samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    n = max(1, -(-samples.size // frame))
    buf = np.zeros(n * frame, dtype=np.float32)
    buf[: samples.size] = samples
    rows = buf.reshape(n, frame)
    if n > max_frames:
        rows = rows[np.linspace(0, n - 1, max_frames).round().astype(np.int64)]
    return torch.from_numpy(np.ascontiguousarray(rows))


def _wav_samples(data: bytes) -> np.ndarray:
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, channels = w.getsampwidth(), w.getnchannels()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, ValueError) as exc:
        raise MediaError(f"audio is not a valid WAV file ({str(exc) or 'its header is cut short'})") from None
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 4:
        x = np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2147483648.0
    else:
        raise MediaError(f"WAV sample width {width} bytes is not supported (1, 2 or 4)")
    if channels > 1:
        x = x[: x.size - x.size % channels].reshape(-1, channels).mean(axis=1)
    if x.size == 0:
        raise MediaError("audio has no samples")
    return x
