"""Mutated payloads for every registered stage, decoded as a receiver would (a script).

Run by ``tests/test_fuzz_payloads.py`` in a subprocess: it warms every decoder on a
valid payload, then caps its own address space (``RLIMIT_AS``: what it uses now plus
``HEADROOM``) and decodes each mutation with the shape the receiver expects. One line
per case on stdout: ``ok`` (the expected tensor, or ``PayloadError``) or ``BAD`` with
the exception. A crash (a signal) or a hang shows as the child's exit or timeout
after the last line it printed.

Mutations: bit flips, truncation and extension of the bytes, and changes to the tree
(every meta value and every coded field's dtype and shape set to hostile values),
re-sealed so no checksum can hide them, since any sender can compute a checksum.
"""

from __future__ import annotations

import random
import resource
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import gradzip
from gradzip import Payload, PayloadError
from gradzip.codecs.base import Compressor, LosslessCoder
from gradzip.codecs.entropy import _frame

HEADROOM = 512 << 20  # bytes of address space beyond the warmed process
SHAPES = [torch.Size((64, 300))]
HOSTILE_INTS = (-5, 0, 1, 255, 2**31, 2**40, 2**62)
HOSTILE_SHAPES = ((), (2**28,), (2**14, 2**14), (0,), (19199,), (1, 1, 1, 1, 1, 1, 1, 1, 1))


def specs() -> list[str]:
    """Every registered compressor alone, the wrapper, and every coder after a quantizer
    and after ``none``."""
    out = []
    for name, cls in sorted(gradzip.registered().items()):
        if issubclass(cls, Compressor):
            out.append(name)
        elif issubclass(cls, LosslessCoder):
            out += [f"int8 | {name}", f"none | {name}"]
    return out + ["ef | topk(ratio=0.05)", "topk(ratio=0.05) | qsgd | eg"]


def _nodes(p: Payload) -> Iterator[Payload]:
    yield p
    for value in p.fields.values():
        if isinstance(value, Payload):
            yield from _nodes(value)


def reseal(p: Payload) -> Payload:
    """Recompute every coded field's checksum, innermost first (as a forger would)."""
    for value in p.fields.values():
        if isinstance(value, Payload):
            reseal(value)
    if _frame.DIGEST in p.meta or _frame.CRC in p.meta:
        p.meta.pop(_frame.CRC, None)
        _frame.seal(p)
    return p


def tree_mutations(blob: bytes, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """``count`` payloads with one meta value of one node set to a hostile value."""
    out = []
    n_nodes = sum(1 for _ in _nodes(Payload.deserialize(blob)))
    for _ in range(count):
        p = Payload.deserialize(blob)
        node = list(_nodes(p))[rng.randrange(n_nodes)]
        if not node.meta:
            continue
        key = rng.choice(sorted(node.meta))
        old = node.meta[key]
        if isinstance(old, tuple):
            node.meta[key] = rng.choice(HOSTILE_SHAPES)
        elif key == "dt":
            node.meta[key] = rng.randrange(10)
        else:
            node.meta[key] = rng.choice(HOSTILE_INTS)
        out.append((f"meta {key}={node.meta[key]!r}", reseal(p).serialize()))
    return out


def byte_mutations(blob: bytes, rng: random.Random, flips: int) -> list[tuple[str, bytes]]:
    out = []
    for _ in range(flips):
        i = rng.randrange(len(blob))
        b = bytearray(blob)
        b[i] ^= 1 << rng.randrange(8)
        out.append((f"flip byte {i}", bytes(b)))
    for cut in sorted({1, 3, len(blob) // 2, len(blob) - 5, len(blob) - 1}):
        out.append((f"truncate to {cut}", blob[:cut]))
    out += [("extend by 1", blob + b"\0"), ("extend by 100", blob + bytes(100))]
    return out


def crafted() -> list[tuple[str, bytes]]:
    """Hand-made hostile payloads: deep nesting, a huge declared NaN tensor."""
    deep_bytes = b"GZ\x01" + b"\x00\x01\x01v\x02" * 5000 + b"\x00\x00"
    nan = Payload({}, {"shape": (2**28,), "dtype": 7, "nan": 1}).serialize()
    return [("5000 nested nodes", deep_bytes), ("nan, shape (2^28,)", nan)]


def run_case(decode: Callable[[bytes], torch.Tensor], what: str, data: bytes,
             shape: torch.Size) -> str:
    try:
        out = decode(data)
    except PayloadError as e:
        if "allocate" in str(e) or "out of memory" in str(e):  # an allocation, wrapped
            return f"BAD {what}: {str(e)[:160]}"
        return f"ok {what}: PayloadError"
    except BaseException as e:  # noqa: BLE001 - exactly what the test looks for
        return f"BAD {what}: {type(e).__name__}: {str(e)[:160]}"
    if out.shape != shape:
        return f"BAD {what}: decoded shape {tuple(out.shape)}"
    return f"ok {what}: decoded"


def main(seed: int, flips: int, tree: int) -> None:
    rng = random.Random(seed)
    x = torch.randn(SHAPES[0].numel(), generator=torch.Generator().manual_seed(seed))
    cases: list[tuple[str, Callable[[bytes], torch.Tensor], bytes]] = []
    for spec in specs():
        codec = gradzip.codec(spec, nonfinite="propagate")
        blob = codec.encode(x.clone(), "k", SHAPES).serialize()

        def decode(data: bytes, codec: gradzip.Codec = codec) -> torch.Tensor:
            return codec.decode(Payload.deserialize(data), None, SHAPES, expected=x.shape)

        decode(blob)  # warm: kernels compiled, caches filled, before the limit
        for what, data in byte_mutations(blob, rng, flips) + tree_mutations(blob, rng, tree):
            cases.append((f"{spec} | {what}", decode, data))
        if spec == "none":
            for what, data in crafted():
                cases.append((f"{spec} | {what}", decode, data))
    status = Path("/proc/self/status").read_text()
    used = int(status.split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + HEADROOM, resource.RLIM_INFINITY))
    print(f"cases {len(cases)}; address space capped at {(used + HEADROOM) >> 20} MiB",
          flush=True)
    for what, decode, data in cases:
        print(run_case(decode, what, data, x.shape), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
