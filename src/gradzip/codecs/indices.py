"""Which positions a sparsifier kept: the shared wire form, and fast helpers to find them.

Every sparsifier (``topk``, ``threshold``, ``dgc``) sends the kept values plus a
description of *where* they were. This module owns that description, so all of
them put the same bytes on the wire and decode the same way.

Wire form (fields and meta of the sparsifier's payload)::

    meta sel = "delta":   values float32[k]  the kept entries, in ascending position order
                          deltas int32[k]    first position, then the gap to each next one
    meta sel = "bitmap":  values float32[k]  (as above)
                          bitmap uint8[ceil(numel / 8)]  bit i (LSB first) = position i kept
    meta sel = "dense":   values float32[numel]  every entry, the dropped ones as 0

The encoder picks the smallest: ``k * (4 + 4)`` bytes for values and gaps,
``4k + numel / 8`` for values and bitmap (so the bitmap wins above 1/32 = 3.1%
density), ``4 * numel`` for dense (which wins above 31/32 density, and is the
cheapest to encode and decode). Positions are int32, or int64 only when
``numel >= 2**31``. Sorted positions are sent as gaps because gaps are small,
non-negative and roughly geometric for scattered selections, so a following
lossless stage (Exp-Golomb, ANS) codes them in a few bits each, while raw positions
are near-uniform over ``log2(numel)`` bits and barely compress (``topk(ratio=0.01)``
goes from 50x to ~78x with ``| eg``).

CPU work goes through NumPy in cache-sized chunks: a 16M-element tensor is scanned
in 15-30 ms on one core, where the plain torch ops (``x.abs() >= t`` then ``nonzero``) spend
most of their time faulting in 64 MB temporaries. NumPy also asks the kernel for
huge pages for large arrays, which makes the decoder's big zero-filled output
about 3x cheaper to allocate. Other devices use equivalent torch ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradzip.codecs.payload import Field, Payload, PayloadError, varint_len
from gradzip.codecs.validation import DeferredChecks, deferring

SEL = "sel"          # meta key naming the form
DELTA = "delta"      # sorted positions as gaps
BITMAP = "bitmap"    # one bit per position
DENSE = "dense"      # all values, zeros where dropped
FORMS = (DELTA, BITMAP, DENSE)

#: set False to force the torch code path on CPU (tests check both paths agree)
NUMPY_FAST = True
_CHUNK = 1 << 16     # elements per chunk of the CPU scan (256 KB of float32: stays in L2)


def index_dtype(numel: int) -> torch.dtype:
    """int32 positions, int64 only for tensors too large for int32."""
    return torch.int32 if numel < 2**31 else torch.int64


def _fast(t: torch.Tensor) -> bool:
    return NUMPY_FAST and t.device.type == "cpu"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _t(a: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` that also gives empty results ordinary strides.

    ``torch.from_numpy`` turns an empty array into a tensor with stride 0, which
    cannot be viewed as bytes when the payload is serialized.
    """
    if a.size == 0:
        return torch.empty(a.shape, dtype=torch.from_numpy(a).dtype)
    return torch.from_numpy(np.ascontiguousarray(a))


# ---------------------------------------------------------------- scans
def abs_ge(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool mask of ``|flat| >= threshold`` (one pass; no float temporaries on CPU)."""
    if not _fast(flat):
        return flat.abs() >= threshold
    x = _np(flat)
    n = x.size
    out = np.empty(n, dtype=np.bool_)
    buf = np.empty(min(n, _CHUNK), dtype=x.dtype)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        a = buf[: stop - start]
        np.abs(x[start:stop], out=a)
        np.greater_equal(a, threshold, out=out[start:stop])
    return _t(out)


def abs_ge_positions(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Ascending int64 positions where ``|flat| >= threshold``, for sparse results.

    Same as ``flatnonzero(abs_ge(flat, threshold))`` but on CPU the mask of each
    chunk is read back while it is still in cache, so no full-size mask is written.
    """
    if not _fast(flat):
        return torch.nonzero(flat.abs() >= threshold).reshape(-1)
    x = _np(flat)
    n = x.size
    buf = np.empty(min(n, _CHUNK), dtype=x.dtype)
    mask = np.empty(min(n, _CHUNK), dtype=np.bool_)
    parts = []
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        a, m = buf[: stop - start], mask[: stop - start]
        np.abs(x[start:stop], out=a)
        np.greater_equal(a, threshold, out=m)
        found = np.flatnonzero(m)
        if found.size:
            parts.append(found + start)
    return _t(np.concatenate(parts) if parts else np.empty(0, dtype=np.int64))


def count(mask: torch.Tensor) -> int:
    """Number of True entries (``bool.sum()`` is several times slower on CPU)."""
    if _fast(mask):
        return int(np.count_nonzero(_np(mask)))
    return int(mask.count_nonzero())


def flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions of the True entries of a 1-D mask."""
    if _fast(mask):
        return _t(np.flatnonzero(_np(mask)))
    return torch.nonzero(mask).reshape(-1)


def zeros(numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A float32 zero vector; on CPU backed by NumPy (huge pages: cheaper to fault in)."""
    if NUMPY_FAST and torch.device(device).type == "cpu":
        return torch.from_numpy(np.zeros(numel, dtype=np.float32))
    return torch.zeros(numel, dtype=torch.float32, device=device)


def empty(numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised float32 vector, allocated like ``zeros``."""
    if NUMPY_FAST and torch.device(device).type == "cpu":
        return torch.from_numpy(np.empty(numel, dtype=np.float32))
    return torch.empty(numel, dtype=torch.float32, device=device)


def packbits(mask: torch.Tensor) -> torch.Tensor:
    """uint8[ceil(n/8)]: bit j of byte i is ``mask[8i + j]`` (least significant first)."""
    if _fast(mask):
        return _t(np.packbits(_np(mask), bitorder="little"))
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    bits = padded.view(-1, 8)
    out = torch.zeros(bits.shape[0], dtype=torch.uint8, device=mask.device)
    for j in range(8):
        out |= bits[:, j] << j
    return out


def unpackbits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``packbits``: a bool mask of ``numel`` entries."""
    if _fast(bits):
        return _t(np.unpackbits(_np(bits), count=numel, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.reshape(-1, 1) >> shifts) & 1).reshape(-1)[:numel].bool()


def _field_len(name: str, count: int, itemsize: int) -> int:
    """Serialized bytes of a 1-D tensor field (see ``payload.py``'s layout)."""
    return varint_len(len(name)) + len(name) + 3 + varint_len(count) + count * itemsize


# ---------------------------------------------------------------- selection
@dataclass
class Selection:
    """Kept positions of a flat tensor of ``numel`` entries: sorted indices or a mask.

    Exactly one of ``indices`` (int64, strictly ascending) and ``mask`` (bool,
    ``numel`` entries) is set; conversions happen only when the wire form needs them.
    """

    numel: int
    indices: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.indices is None) == (self.mask is None):
            raise ValueError("a Selection needs exactly one of indices or mask")

    @property
    def count(self) -> int:
        if self.indices is not None:
            return self.indices.numel()
        assert self.mask is not None
        return count(self.mask)

    def as_indices(self) -> torch.Tensor:
        if self.indices is None:
            assert self.mask is not None
            self.indices = flatnonzero(self.mask)
        return self.indices

    def as_mask(self) -> torch.Tensor:
        if self.mask is None:
            assert self.indices is not None
            mask = torch.zeros(self.numel, dtype=torch.bool, device=self.indices.device)
            mask[self.indices] = True
            self.mask = mask
        return self.mask

    def form(self) -> str:
        """The wire form that serializes smallest, headers included (ties: delta first)."""
        n, k = self.numel, self.count
        itemsize = torch.empty(0, dtype=index_dtype(n)).element_size()
        sizes = {
            DELTA: _field_len("values", k, 4) + _field_len("deltas", k, itemsize),
            BITMAP: _field_len("values", k, 4) + _field_len("bitmap", math.ceil(n / 8), 1),
            DENSE: _field_len("values", n, 4),
        }
        return min(FORMS, key=lambda f: sizes[f] + len(f))

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The kept entries of ``flat``, in ascending position order (a copy)."""
        if self.indices is None and _fast(flat):
            assert self.mask is not None
            return _t(_np(flat)[_np(self.mask)])
        if self.indices is None:
            assert self.mask is not None
            return flat[self.mask]
        return flat[self.indices]

    def masked(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` with the entries not kept set to 0 (a copy): the dense form's values."""
        mask = self.as_mask()
        if _fast(flat):
            return _t(np.where(_np(mask), _np(flat), np.float32(0)))
        return torch.where(mask, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))

    def fields(self, form: str) -> dict[str, Field]:
        """The position fields of ``form`` ("delta" or "bitmap") to send next to ``values``."""
        if form == BITMAP:
            return {"bitmap": packbits(self.as_mask())}
        if form != DELTA:
            raise ValueError(f"positions are sent as {DELTA!r} or {BITMAP!r}, not {form!r}")
        idx = self.as_indices()
        dtype = index_dtype(self.numel)
        if _fast(idx):
            np_dtype = np.int32 if dtype == torch.int32 else np.int64
            deltas = _t(np.diff(_np(idx), prepend=0).astype(np_dtype))
        else:
            deltas = torch.diff(idx, prepend=idx.new_zeros(1)).to(dtype)
        return {"deltas": deltas}

    @classmethod
    def from_payload(cls, p: Payload, numel: int, k: int) -> Selection:
        """Read and validate the positions of ``k`` kept values from ``p``."""
        form = p.meta.get(SEL)
        if form == BITMAP:
            bits = p.tensor("bitmap").reshape(-1)
            if bits.dtype != torch.uint8 or bits.numel() != math.ceil(numel / 8):
                raise PayloadError(
                    f"bitmap must be uint8[{math.ceil(numel / 8)}] for {numel} entries, "
                    f"got {bits.dtype}[{bits.numel()}]"
                )
            mask = unpackbits(bits, numel)
            checks = deferring()
            if checks is not None:  # the count checked later: free on the host, else on
                message = f"a bitmap marks as many positions as values came ({k})"
                if _fast(mask):  # the device with fixed-size positions
                    matches = count(mask) == k
                    checks.require(torch.tensor(matches), message)
                    if matches:
                        return cls(numel, mask=mask)
                else:
                    checks.require(mask.sum() == k, message)
                return cls(numel, indices=torch.nonzero_static(mask, size=k,
                                                               fill_value=0).reshape(-1))
            if count(mask) != k:
                raise PayloadError(f"bitmap marks {count(mask)} positions but {k} values came")
            return cls(numel, mask=mask)
        if form == DELTA:
            deltas = p.tensor("deltas").reshape(-1)
            if deltas.dtype not in (torch.int32, torch.int64) or deltas.numel() != k:
                raise PayloadError(
                    f"deltas must be int32/int64[{k}], got {deltas.dtype}[{deltas.numel()}]"
                )
            if k == 0:
                return cls(numel, indices=torch.zeros(0, dtype=torch.int64))
            checks = deferring()
            if checks is not None and not _fast(deltas):
                return cls(numel, indices=_checked_later(deltas, numel, checks))
            if _fast(deltas):  # NumPy values: no tensor is read
                d = _np(deltas)
                positions = np.cumsum(d, dtype=np.int64)
                bad = bool(d[0] < 0 or (k > 1 and d[1:].min() <= 0)
                           or positions[-1] >= numel)
                idx = _t(positions)
                if checks is not None:  # deferred: recorded, positions kept in range
                    checks.require(torch.tensor(not bad), f"sparse positions ascend below "
                                   f"{numel}")
                    return cls(numel, indices=idx.clamp_(0, numel - 1) if bad else idx)
            else:
                bad = bool(deltas[0] < 0) or (k > 1 and bool((deltas[1:] <= 0).any()))
                idx = deltas.cumsum(0, dtype=torch.int64)
            if bad or int(idx[-1]) >= numel:
                raise PayloadError(f"deltas do not give ascending positions below {numel}")
            return cls(numel, indices=idx)
        raise PayloadError(
            f"sparse payload meta {SEL!r} must be one of {', '.join(FORMS)}; got {form!r}"
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """A flat float32 tensor of ``numel``: ``values`` at the kept positions, 0 elsewhere."""
        values = values.reshape(-1).float()
        out = zeros(self.numel, values.device)
        if self.indices is not None:
            if _fast(out):
                _np(out)[_np(self.indices)] = _np(values)
            else:
                out[self.indices] = values
        else:
            assert self.mask is not None
            if _fast(out):
                _np(out)[_np(self.mask)] = _np(values)
            else:
                out[self.mask] = values
        return out


def _checked_later(deltas: torch.Tensor, numel: int, checks: DeferredChecks) -> torch.Tensor:
    """Positions from gaps without a host read: whether they ascend below ``numel`` is
    recorded in ``checks``, and they are clamped into range so a bad payload cannot
    write outside the tensor before the check is read."""
    idx = deltas.cumsum(0, dtype=torch.int64)
    ok = (deltas[0] >= 0) & (deltas[1:] > 0).all() & (idx[-1] < numel)
    checks.require(ok, f"sparse positions ascend below {numel}")
    return idx.clamp_(0, numel - 1)


def sparse_payload(flat: torch.Tensor, sel: Selection, form: str | None = None) -> Payload:
    """A payload of the entries of ``flat`` kept by ``sel`` and where they were.

    ``values`` (float32) is the field a following quantizer may compress. ``form``
    forces "delta", "bitmap" or "dense"; by default the smallest one is sent.
    """
    form = form or sel.form()
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}; got {form!r}")
    if form == DENSE:
        return Payload({"values": sel.masked(flat).float()}, {SEL: DENSE})
    fields = sel.fields(form)  # may turn a mask into indices: gather then uses them
    return Payload({"values": sel.gather(flat).float(), **fields}, {SEL: form})


def sparse_decode(p: Payload, shape: torch.Size) -> torch.Tensor:
    """Inverse of ``sparse_payload``: the dense float32 tensor of ``shape``."""
    numel = math.prod(shape)
    values = p.tensor("values").reshape(-1)
    if p.meta.get(SEL) == DENSE:
        if values.numel() != numel:
            raise PayloadError(f"dense sparse payload has {values.numel()} values for {numel}")
        return values.float().reshape(shape)
    sel = Selection.from_payload(p, numel, values.numel())
    return sel.scatter(values).reshape(shape)
