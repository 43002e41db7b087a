"""GENSERVER_PNG_COMPRESS_LEVEL: the PNGs workers write take the level at call time, decode to the same pixels at
every level, and a level zlib does not have is refused naming the variable."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from genserver.config import SettingsError
from workers.runtime.common import png_bytes


def picture() -> Image.Image:
    ramp = np.linspace(0, 255, 128)
    return Image.fromarray(np.stack([np.add.outer(ramp, ramp) / 2] * 3, -1).astype(np.uint8))


def test_the_level_trades_bytes_and_never_pixels(monkeypatch):
    sizes, pixels = {}, {}
    for level in (0, 1, 9):
        monkeypatch.setenv("GENSERVER_PNG_COMPRESS_LEVEL", str(level))
        data = png_bytes(picture())
        sizes[level], pixels[level] = len(data), np.asarray(Image.open(io.BytesIO(data)))
    assert sizes[0] > sizes[1] >= sizes[9]
    assert all(np.array_equal(pixels[0], p) for p in pixels.values())
    assert np.array_equal(pixels[1], np.asarray(picture()))


def test_the_default_is_level_1_and_a_level_out_of_range_is_refused(monkeypatch):
    monkeypatch.delenv("GENSERVER_PNG_COMPRESS_LEVEL", raising=False)
    default = png_bytes(picture())
    monkeypatch.setenv("GENSERVER_PNG_COMPRESS_LEVEL", "1")
    assert png_bytes(picture()) == default
    monkeypatch.setenv("GENSERVER_PNG_COMPRESS_LEVEL", "10")
    with pytest.raises(SettingsError, match="GENSERVER_PNG_COMPRESS_LEVEL"):
        png_bytes(picture())
