"""The rANS decoder of ``_rans`` on four chunks at once, each chunk's eight states in one
SIMD register.

One chunk's eight states in a register decode *slower* than ``_rans.decode`` (0.7-0.8x
here): every block waits on its table lookups (a 128 KB table, so L2 latency) before
the next can start. A stream has one set of eight states per chunk, though, and the
chunks are independent, so this decoder steps four chunks (or two) in one loop: four
dependency chains in flight. Each chunk's step, for symbols ``i .. i + 7``:

1. The eight slots ``x & (2**15 - 1)`` go through the stack to scalar registers (a
   lane extract costs two instructions here, a load one); each slot's table entry is
   loaded into a vector lane, and its value stored to ``out``.
2. ``x = freq * (x >> 15) + (slot - start)`` in every lane (``vpmulld``).
3. Lanes that fell below 2**16 take the next words in lane order: the next eight words
   are loaded into both halves of a register and a byte shuffle (``pshufb``) with a
   control picked by the lanes' mask spreads them to those lanes; the word position
   moves by the mask's popcount.

Chunks shorter than the others (the last) and the last symbols of each chunk (those of
a partial block, or when fewer than eight words remain) go through the scalar decoder's
step, which checks every read. The result is that of ``_rans.decode_chunks``, word for
word, including the verdict on damaged streams.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from gradzip.codecs.entropy import _rans, _simd

#: whether this host runs this vector kernel (else ``ans`` uses ``_rans``'s)
AVAILABLE = _simd.AVAILABLE
STATES = _rans.STATES


def _spread_controls() -> np.ndarray:
    """``_simd.pshufb`` controls, 32 bytes for each 8-bit mask of refilling lanes: lane ``k``
    (a 32-bit lane) takes the j-th of the next words if it is the j-th refilling lane,
    zero-extended; other lanes get zero. Both 16-byte halves hold the same eight words."""
    controls = np.full((256, 32), 0x80, np.uint8)  # 0x80: a zero byte
    for mask in range(256):
        lanes = [k for k in range(STATES) if mask >> k & 1]
        for j, lane in enumerate(lanes):
            controls[mask, 4 * lane:4 * lane + 2] = (2 * j, 2 * j + 1)
    return controls.ravel()


_CONTROLS = _spread_controls()


class _Pointers:
    """The raw pointers one chunk's step reads and writes."""

    def __init__(self, words: Any, table: Any, values: Any, out: Any, controls: Any,
                 slots: Any) -> None:
        self.words, self.table, self.values, self.out = words, table, values, out
        self.controls, self.slots = controls, slots


def _lookups(builder: ir.IRBuilder, x: Any, first: Any, at: _Pointers) -> Any:
    """Each lane's table entry, gathered by scalar loads; its value stored to
    ``out[first + k]``. The slots go through a stack slot (volatile, so LLVM keeps the
    one vector store and eight scalar loads rather than lane extracts)."""
    builder.store(builder.and_(x, _simd.splat(_simd.V8X32, _rans.M - 1)), at.slots).volatile = True
    lanes = builder.bitcast(at.slots, _simd.I32.as_pointer())
    entries = ir.Constant(_simd.V8X32, ir.Undefined)
    for k in range(STATES):
        slot = builder.load(builder.gep(lanes, [_simd.const(k)]))
        slot.volatile = True
        s = builder.zext(slot, _simd.I64)
        entry = builder.load(builder.gep(at.table, [s]))
        entries = builder.insert_element(entries, entry, ir.Constant(_simd.I32, k))
        value = builder.load(builder.gep(at.values, [s]))
        builder.store(value, builder.gep(at.out, [builder.add(first, _simd.const(k))]))
    return entries


def _step(builder: ir.IRBuilder, x: Any, p: Any, first: Any, at: _Pointers
          ) -> tuple[Any, Any]:
    """Decode one chunk's symbols ``first .. first + 7`` (its states ``x``, its next word
    at ``p``); returns the new states and word position."""
    e = _lookups(builder, x, first, at)
    x = builder.add(builder.mul(builder.lshr(e, _simd.splat(_simd.V8X32, 16)),
                                builder.lshr(x, _simd.splat(_simd.V8X32, _rans.SCALE_BITS))),
                    builder.and_(e, _simd.splat(_simd.V8X32, 0xFFFF)))
    need = builder.icmp_unsigned("<", x, _simd.splat(_simd.V8X32, _rans.L))
    mask = _simd.lane_mask(builder, need)
    words = builder.load(builder.bitcast(builder.gep(at.words, [p]), _simd.V16X8.as_pointer()),
                         align=1)
    both = _simd.shuffle(builder, words, words, list(range(16)) * 2)
    control = _simd.control_row(builder, at.controls, mask, _simd.V32X8)
    spread = builder.bitcast(_simd.pshufb(builder, both, control), _simd.V8X32)
    refilled = builder.or_(builder.shl(x, _simd.splat(_simd.V8X32, 16)), spread)
    return builder.select(need, refilled, x), builder.add(p, _simd.popcount(builder, mask))


@cache
def _blocks(group: int) -> Any:
    """The intrinsic that decodes ``group`` chunks of equal length side by side."""

    @intrinsic
    def decode_blocks(typingctx: Any, words: Any, ps: Any, ends: Any, table: Any, values: Any,
                      out: Any, offsets: Any, n: Any, xs: Any, controls: Any) -> Any:
        """Decode blocks of eight symbols of each chunk ``c`` (states ``xs[c]``, next
        word ``ps[c]``, words up to ``ends[c]``, symbols to ``out[offsets[c]:]``) while
        every chunk has eight symbols (of ``n``) and eight words left. Updates ``xs`` and
        ``ps``; returns the symbols decoded in each chunk."""
        if not (_simd.contiguous(words, ps, ends, table, values, out, offsets, xs, controls)
                and values.dtype == out.dtype):
            return None
        sig = types.uint64(words, ps, ends, table, values, out, offsets, n, xs, controls)

        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
            def pointer(k: int, element: Any) -> Any:
                return _simd.data(context, builder, sig.args[k], args[k], element)

            element = context.get_value_type(out.dtype)
            slots = cgutils.alloca_once(builder, _simd.V8X32)  # in the entry block
            at = _Pointers(pointer(0, _simd.I16), pointer(3, _simd.I32), pointer(4, element),
                           pointer(5, element), pointer(9, _simd.I8), slots)
            ps_p, ends_p, offsets_p, xs_p = (pointer(1, _simd.I64), pointer(2, _simd.I64),
                                             pointer(6, _simd.I64), pointer(8, _simd.V8X32))
            n_v = context.cast(builder, args[7], sig.args[7], types.uint64)

            def loads(p: Any, **kw: Any) -> list[Any]:
                return [builder.load(builder.gep(p, [_simd.const(c)]), **kw) for c in range(group)]

            ends_v, offsets_v = loads(ends_p), loads(offsets_p)
            x0, p0 = loads(xs_p, align=4), loads(ps_p)
            entry = builder.block
            head = builder.append_basic_block("rans_head")
            body = builder.append_basic_block("rans_body")
            done = builder.append_basic_block("rans_done")
            builder.branch(head)
            builder.position_at_end(head)
            xs_v = [builder.phi(_simd.V8X32) for _ in range(group)]
            ps_v = [builder.phi(_simd.I64) for _ in range(group)]
            i = builder.phi(_simd.I64)
            for phi, value in zip([*xs_v, *ps_v, i], [*x0, *p0, _simd.const(0)], strict=True):
                phi.add_incoming(value, entry)
            more = builder.icmp_unsigned("<=", builder.add(i, _simd.const(STATES)), n_v)
            for p, end in zip(ps_v, ends_v, strict=True):
                room = builder.icmp_unsigned("<=", builder.add(p, _simd.const(STATES)), end)
                more = builder.and_(more, room)
            builder.cbranch(more, body, done)
            builder.position_at_end(body)
            steps = [_step(builder, xs_v[c], ps_v[c], builder.add(offsets_v[c], i), at)
                     for c in range(group)]
            for c, (x_next, p_next) in enumerate(steps):
                xs_v[c].add_incoming(x_next, builder.block)
                ps_v[c].add_incoming(p_next, builder.block)
            i.add_incoming(builder.add(i, _simd.const(STATES)), builder.block)
            builder.branch(head)
            builder.position_at_end(done)
            for c in range(group):
                builder.store(xs_v[c], builder.gep(xs_p, [_simd.const(c)]), align=4)
                builder.store(ps_v[c], builder.gep(ps_p, [_simd.const(c)]))
            return i
        return sig, codegen
    return decode_blocks


_FOUR, _TWO = _blocks(4), _blocks(2)


@njit(cache=True, nogil=True)
def _finish(words, p, end, table, values, out, i, xs):
    """The rest of one chunk from symbol ``i`` with the scalar step, every read checked;
    0 if the chunk ends consistent (every word used, every state back at 2**16)."""
    n = np.uint64(out.size)
    eight = np.uint64(STATES)
    while i < n:
        word = words[p] if p < end else np.uint16(0)
        xs[i % eight], used = _rans.pop_symbol(xs[i % eight], table, values, word, out, i)
        p += used
        if p > end:
            return -1
        i += np.uint64(1)
    if p != end or (xs != np.uint32(_rans.L)).any():
        return -1
    return 0


@njit(cache=True, nogil=True)
def _group(words, bounds, chunk, first, group, table, values, controls, out):
    """Decode chunks ``first .. first + group - 1`` (all ``chunk`` symbols long)."""
    ps = np.empty(group, np.int64)
    ends = np.empty(group, np.int64)
    offsets = np.empty(group, np.int64)
    xs = np.empty((group, STATES), np.uint32)
    for c in range(group):
        begin, ends[c] = bounds[first + c], bounds[first + c + 1]
        if ends[c] - begin < 2 * STATES:
            return -1
        for k in range(STATES):
            xs[c, k] = _rans.load_state(words[begin:], k)
        ps[c] = begin + 2 * STATES
        offsets[c] = (first + c) * chunk
    if group == 4:
        i = _FOUR(words, ps, ends, table, values, out, offsets, np.uint64(chunk), xs, controls)
    else:
        i = _TWO(words, ps, ends, table, values, out, offsets, np.uint64(chunk), xs, controls)
    for c in range(group):
        part = out[offsets[c]:offsets[c] + chunk]
        if _finish(words, np.uint64(ps[c]), np.uint64(ends[c]), table, values, part, i,
                   xs[c]) < 0:
            return -1
    return 0


@njit(cache=True, nogil=True)
def _decode_chunks(words, bounds, chunk, table, values, controls, out):
    chunks = bounds.size - 1
    full = out.size // chunk
    c = 0
    while c < chunks:
        group = 4 if full - c >= 4 else (2 if full - c >= 2 else 1)
        if group > 1:
            status = _group(words, bounds, chunk, c, group, table, values, controls, out)
        else:
            status = _rans.decode(words[bounds[c]:bounds[c + 1]], table, values,
                                  out[c * chunk:(c + 1) * chunk])
        if status < 0:
            return -1
        c += group
    return 0


def decode_chunks(words: np.ndarray, sizes: tuple[int, ...], chunk: int, table: np.ndarray,
                  values: np.ndarray, out: np.ndarray) -> int:
    """``_rans.decode_chunks`` with chunks decoded four (or two) at a time."""
    bounds = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=bounds[1:])
    return int(_decode_chunks(np.ascontiguousarray(words), bounds, chunk, table,
                              np.ascontiguousarray(values), _CONTROLS, out))
