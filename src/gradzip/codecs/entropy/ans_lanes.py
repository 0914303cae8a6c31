"""``ans``'s lanes format as a payload: coded on the device, decoded on either side.

A field on a CUDA device is coded there (``codecs/kernels/rans.py``) and its payload's
tensors stay there: the table, each block's word count, final states and checksum, and
the words. The only host read is the word count that sizes the payload. The same
payload decodes with the kernel on a GPU or with the CPU reference (``lanes.py``) on
a host, to the same tensor: which side wrote it does not matter, the format is one.

Where coding does not pay (a short field, random bytes) the field travels as its raw
bytes in a tensor (mode ``rawt``), still on the device, with a checksum of them.

The payload's tensors are not covered by ``_frame``'s host checksum (hashing them would
copy them to the host): each block carries its own checksum, checked by the decoder
with its final states and word count. Every header value is checked against the
tensors' shapes; the table and counts, whose checks need their values, are checked
with the blocks' results, at once (one host read) or under deferred checks
(``validation.py``) as a flag on the device, the output then being made from safe
reads whatever the bytes said.
"""

from __future__ import annotations

import torch

from gradzip.codecs import kernels
from gradzip.codecs.entropy import _frame, lanes
from gradzip.codecs.payload import MetaValue, Payload
from gradzip.codecs.validation import require

#: the format's mode names: coded by lanes, or the raw bytes as a tensor
LANES, RAW = "lanes", "rawt"
MODES = (LANES, RAW)


def encode(t: torch.Tensor) -> Payload:
    """Code an integer tensor in the lanes format where ``t`` is (kernel on a GPU,
    reference on a CPU); its raw bytes where coding does not pay."""
    meta: dict[str, MetaValue] = {"dt": _frame.dtype_code(t), "sh": tuple(t.shape)}
    if not t.numel():
        return raw(t)
    planes = lanes.planes_of(t)
    if kernels.runs_on(planes):
        from gradzip.codecs.kernels import rans
        coded = rans.encode(planes, lanes.quantize(rans.histogram(planes)))
    else:  # the reference, which runs on the host, wherever the tensor is
        host = planes.cpu()
        coded = _moved(lanes.encode(host, lanes.quantize(lanes.histogram(host))),
                       planes.device)
    payload = Payload({"t": coded.freq, "w": coded.words, "s": coded.states,
                       "h": coded.sums, "d": coded.data},
                      {"m": LANES, **meta, "np": planes.shape[0], "ck": lanes.BLOCK})
    return raw(t) if payload.wire_bytes >= _raw_size(t) else payload


def raw(t: torch.Tensor) -> Payload:
    """``t``'s bytes as a tensor where ``t`` is, with their checksum (mode ``rawt``): the
    form of a field that coding would not shrink, kept on the device."""
    data = _bytes_of(t)
    return _raw_payload(t, data, lanes.byte_checksum(data))


def _raw_size(t: torch.Tensor) -> int:
    """``raw(t).wire_bytes`` without the checksum's pass (sizes depend on shapes only)."""
    return _raw_payload(t, _bytes_of(t), torch.zeros(1, dtype=torch.int32)).wire_bytes


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _raw_payload(t: torch.Tensor, data: torch.Tensor, digest: torch.Tensor) -> Payload:
    return Payload({"d": data, "h": digest},
                   {"m": RAW, "dt": _frame.dtype_code(t), "sh": tuple(t.shape)})


def decode(p: Payload, device: torch.device | None = None) -> torch.Tensor:
    """The exact tensor of a lanes-format field, on ``device`` (default: where its
    tensors are); raises ``EntropyCodingError`` on a malformed or corrupt field (under
    deferred checks: records the check and returns a tensor of the right shape)."""
    dtype, shape, numel = _frame.header(p)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if p.meta.get("m") == RAW:
        data = _tensor(p, "d", torch.uint8, (numel * itemsize,))
        data = data.to(device or data.device)
        want = _tensor(p, "h", torch.int32, (1,)).to(data.device)
        _require((lanes.byte_checksum(data) == want).all())
        return data.view(dtype).reshape(shape)
    nplanes = _frame.meta_int(p, "np", "ans")
    if nplanes != itemsize or _frame.meta_int(p, "ck", "ans") != lanes.BLOCK:
        raise _frame.EntropyCodingError(
            f"ans: lanes field of {nplanes} planes in blocks of {p.meta.get('ck')}; this "
            f"gradzip reads {itemsize} planes in blocks of {lanes.BLOCK}")
    rows = nplanes * lanes.blocks_of(numel)
    coded = lanes.Coded(
        _tensor(p, "t", torch.int16, (nplanes, 256)), _tensor(p, "w", torch.int32, (rows,)),
        _tensor(p, "s", torch.int32, (rows, lanes.LANES)),
        _tensor(p, "h", torch.int32, (rows,)), _tensor(p, "d", torch.int16, None))
    where = torch.device(device) if device is not None else coded.data.device
    coded = _moved(coded, where)
    if kernels.runs_on(coded.data):
        from gradzip.codecs.kernels import rans
        planes, sound = rans.decode(coded, numel)
    else:  # the reference, on the host
        planes, sound = lanes.decode(_moved(coded, torch.device("cpu")), numel)
        planes, sound = planes.to(where), sound.to(where)
    counts = coded.words.to(torch.int64)
    ok = (sound & lanes.table_ok(coded.freq) & (counts >= 0).all()
          & (counts <= lanes.BLOCK).all() & (counts.sum() == coded.data.numel()))
    _require(ok)
    return lanes.from_planes(planes, dtype).reshape(shape)


def _moved(coded: lanes.Coded, device: torch.device) -> lanes.Coded:
    """``coded``'s tensors on ``device`` (no copy where they are there already)."""
    return lanes.Coded(*(x.to(device) for x in (coded.freq, coded.words, coded.states,
                                                 coded.sums, coded.data)))


def _require(ok: torch.Tensor) -> None:
    """Raise unless ``ok`` (one host read), or record it under deferred checks."""
    require(ok, "ans: lanes field is corrupt or truncated (its table, word counts, "
            "states or checksums must match its data)", _frame.EntropyCodingError)


def _tensor(p: Payload, name: str, dtype: torch.dtype,
            shape: tuple[int, ...] | None) -> torch.Tensor:
    """Field ``name``: a tensor of ``dtype`` and ``shape`` (1-D of any length: None)."""
    value = p.fields.get(name)
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or (
            value.dim() != 1 if shape is None else tuple(value.shape) != shape):
        raise _frame.EntropyCodingError(
            f"ans: lanes field {name!r} must be a {dtype} tensor of shape "
            f"{shape if shape is not None else '(n,)'}")
    return value
