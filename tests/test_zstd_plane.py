"""zstd for one byte plane (``_zstd_plane``): exact, standard frames, Huffman literals
behind an accelerated match search, damaged frames refused, a fallback without cffi."""

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.codecs.entropy import _zstd_plane
from gradzip.codecs.entropy._frame import EntropyCodingError

needs_cffi = pytest.mark.skipif(not _zstd_plane.accelerated(),
                                   reason="cffi is not installed")


def exponent_like(n, seed=0):
    """i.i.d. bytes of ~3 bits of entropy, as gradient exponents, with a zero run."""
    rng = np.random.default_rng(seed)
    plane = (120 - np.minimum(rng.geometric(0.35, n), 40)).astype(np.uint8)
    plane[n // 3: n // 3 + n // 10] = 0
    return plane


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.sampled_from([0, 1, 4, 64, 255]))
def test_any_bytes_roundtrip_at_any_acceleration(data, acceleration):
    plane = np.frombuffer(data, np.uint8)
    frame = _zstd_plane.compress(plane, acceleration)
    assert _zstd_plane.decompress(frame, plane.size).tobytes() == data


@pytest.mark.parametrize("acceleration", [0, 4])
def test_frames_are_standard_zstd(acceleration):
    plane = exponent_like(300_000)
    frame = _zstd_plane.compress(plane, acceleration)
    assert zstandard.ZstdDecompressor().decompress(frame) == plane.tobytes()


@needs_cffi
def test_accelerated_search_keeps_huffman_literals():
    """zstd turns literal coding off under acceleration unless told otherwise: the frame
    of a 3-bit plane must stay near its entropy, not grow to the raw size."""
    plane = exponent_like(400_000, seed=1)
    counts = np.bincount(plane, minlength=256) / plane.size
    entropy_bytes = -(counts[counts > 0] * np.log2(counts[counts > 0])).sum() / 8 * plane.size
    plain = len(_zstd_plane.compress(plane, 0))
    fast = len(_zstd_plane.compress(plane, 4))
    assert fast < 1.05 * entropy_bytes
    assert fast < 1.05 * plain


def test_frames_without_a_content_size_decode():
    plane = exponent_like(10_000)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(plane.tobytes())
    assert np.array_equal(_zstd_plane.decompress(frame, plane.size), plane)


def test_damaged_or_mis_sized_frames_raise():
    plane = exponent_like(50_000)
    frame = _zstd_plane.compress(plane)
    with pytest.raises(EntropyCodingError, match="wrong size"):
        _zstd_plane.decompress(frame, plane.size - 1)
    with pytest.raises(EntropyCodingError):
        _zstd_plane.decompress(frame[:-7], plane.size)
    with pytest.raises(EntropyCodingError):
        _zstd_plane.decompress(b"\x00" * 16, plane.size)
    nosize = zstandard.ZstdCompressor(write_content_size=False).compress(plane.tobytes())
    with pytest.raises(EntropyCodingError):
        _zstd_plane.decompress(nosize, plane.size + 1)


def test_acceleration_out_of_range_is_refused():
    with pytest.raises(ValueError, match="0..255"):
        _zstd_plane.compress(exponent_like(100), 256)


def test_without_cffi_python_zstandard_writes_the_same_format(monkeypatch):
    plane = exponent_like(40_000)
    accelerated = _zstd_plane.compress(plane, 4)
    monkeypatch.setattr(_zstd_plane, "_LIB", None)
    assert not _zstd_plane.accelerated()
    frame = _zstd_plane.compress(plane, 4)
    assert np.array_equal(_zstd_plane.decompress(frame, plane.size), plane)
    assert np.array_equal(_zstd_plane.decompress(accelerated, plane.size), plane)
    with pytest.raises(EntropyCodingError):
        _zstd_plane.decompress(frame, plane.size + 5)


@needs_cffi
def test_the_kept_scratch_buffer_is_bounded(monkeypatch):
    """Planes above SCRATCH_MAX compress into a buffer of their own, so a thread does not
    keep the largest bucket it ever saw."""
    monkeypatch.setattr(_zstd_plane, "SCRATCH_MAX", 1 << 16)
    monkeypatch.setattr(_zstd_plane, "_local", type(_zstd_plane._local)())
    small, large = exponent_like(10_000), exponent_like(200_000)
    for plane in (small, large):
        frame = _zstd_plane.compress(plane, 4)
        assert np.array_equal(_zstd_plane.decompress(frame, plane.size), plane)
    assert _zstd_plane._local.scratch.size < 1 << 16
