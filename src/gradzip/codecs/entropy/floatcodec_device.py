"""``lossless`` on the device: byte planes split by torch, the exponent coded by ``ans``.

The host path splits a float tensor into byte planes with numba and codes the exponent
plane with Huffman or zstd, which only a host runs. On a CUDA device (where the
``ans`` kernels run, ``kernels.runs_on``) the same planes, the layouts of
``floatcodec`` bit for bit, are split and joined by torch's integer ops where the
tensor is; the exponent plane (fp16's first plane with its sign and two mantissa bits)
is coded by ``ans`` in its lanes format on the device, and the other planes travel as
they are (``ans_lanes.raw``: sign and mantissa bytes are near uniform, the host path
too sends them raw unless a sampled histogram promises 0.5%). The payload keeps
``lossless``'s per-plane format, each plane naming its coder, so either side decodes
the other's; its tensors stay on the device.
"""

from __future__ import annotations

import torch

from gradzip.codecs.entropy import _frame, ans, ans_lanes
from gradzip.codecs.payload import Payload

#: the float dtypes split on the device (fp64 keeps the host path)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def split(x: torch.Tensor) -> list[torch.Tensor]:
    """The byte planes of a flat float tensor (``floatcodec``'s layouts), uint8 each."""
    if x.dtype == torch.float32:
        w = x.view(torch.int32)
        rows = [w >> 23, ((w >> 24) & 0x80) | ((w >> 16) & 0x7F), w >> 8, w]
    else:
        h = x.view(torch.int16).to(torch.int32)
        if x.dtype == torch.bfloat16:
            rows = [h >> 7, ((h >> 8) & 0x80) | (h & 0x7F)]
        else:
            rows = [((h >> 7) & 0xF8) | ((h >> 13) & 0x4) | ((h >> 8) & 0x3), h]
    return [(r & 0xFF).to(torch.uint8) for r in rows]


def join(planes: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``split``: a flat tensor of ``dtype`` from its byte planes."""
    p = [plane.to(torch.int64) for plane in planes]
    if dtype == torch.float32:
        u = ((p[1] & 0x80) << 24) | (p[0] << 23) | ((p[1] & 0x7F) << 16) | (p[2] << 8) | p[3]
        return (u - ((u >> 31) << 32)).to(torch.int32).view(torch.float32)
    if dtype == torch.bfloat16:
        u = ((p[1] & 0x80) << 8) | (p[0] << 7) | (p[1] & 0x7F)
    else:
        u = ((p[0] & 0x4) << 13) | ((p[0] >> 3) << 10) | ((p[0] & 0x3) << 8) | p[1]
    return (u - ((u >> 15) << 16)).to(torch.int16).view(dtype)


def encode_planes(flat: torch.Tensor) -> dict[str, Payload]:
    """Each plane's payload: the first coded by ``ans`` (the lanes kernel where ``flat``
    is on a GPU), the rest as they are, all on ``flat``'s device."""
    planes = split(flat)
    return {f"p{i}": ans.encode(plane) if i == 0 else ans_lanes.raw(plane)
            for i, plane in enumerate(planes)}


def is_device_format(p: Payload, count: int) -> bool:
    """Whether every plane of a ``lossless`` payload is in a device format."""
    return all(isinstance(p.fields.get(f"p{i}"), Payload)
               and p.child(f"p{i}").meta.get("m") in ans_lanes.MODES for i in range(count))


def decode_planes(p: Payload, dtype: torch.dtype, numel: int, count: int) -> torch.Tensor:
    """The flat tensor of a device-format ``lossless`` payload, where its tensors are."""
    device = next((t.device for _, t in p.leaves()), torch.device("cpu"))
    planes = [ans.decode(p.child(f"p{i}"), device) for i in range(count)]
    if any(plane.dtype != torch.uint8 or plane.numel() != numel for plane in planes):
        raise _frame.EntropyCodingError("lossless: a byte plane has the wrong size")
    return join([plane.reshape(-1) for plane in planes], dtype)
