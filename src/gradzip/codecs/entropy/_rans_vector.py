"""The rANS encoder of ``_rans`` with its eight states in one SIMD register.

``_rans.encode`` steps eight interleaved states one after another: ~25 scalar
instructions a symbol, ~300 MB/s here. This module steps all eight at once, one 32-bit
lane each, and writes the same words: ``rans8`` payloads are byte-identical whichever
encoder made them (tested), so the decoder and the format do not change.

A block of eight symbols (symbol ``i + k`` in lane ``k``):

1. Each symbol's 16-byte row ``[x_max - 1, reciprocal, shift, start | (2**15 - freq) << 16]``
   is loaded and the eight rows are transposed into four vectors by in-lane unpacks.
2. Lanes whose state is at least ``x_max`` renormalise: their low 16 bits are the
   words to write. A byte shuffle (``pshufb``) with a control picked by the lanes' mask
   packs those words, in lane order, to the top of a 16-byte register, which is stored
   to end at the write position; the position moves down by the mask's popcount. The
   bytes below the kept words are overwritten by the next (earlier) block.
3. ``q = (x + mulhi(x, rcp)) >> shift`` (the 33-bit Granlund-Montgomery reciprocal of
   ``_rans.encoder_table``, exact for every state below 2**32) in 64-bit even and odd
   halves, then ``x + start + q * (2**15 - freq)``.

The loop is written in LLVM IR (a numba intrinsic) because numba has no vector types;
the byte shuffle is x86's, so the module is ``AVAILABLE`` only on x86-64 hosts with
AVX2, and ``ans`` falls back to ``_rans.encode`` elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from gradzip.codecs.entropy import _rans, _simd

#: whether this host runs this vector kernel (else ``ans`` uses ``_rans``'s)
AVAILABLE = _simd.AVAILABLE
STATES = _rans.STATES
FIELDS = 4  # uint32 words a row: x_max - 1, reciprocal, shift, start | cmpl << 16


def encoder_table(freq: np.ndarray) -> np.ndarray:
    """One 4-word uint32 row per symbol (``FIELDS``), from ``_rans.encoder_table``.

    ``x_max - 1`` fits 32 bits where ``x_max = freq << 17`` (up to 2**32) does not;
    start and ``2**15 - freq`` are both below 2**15 and share a word."""
    wide = _rans.encoder_table(freq)
    rows = np.empty((wide.shape[0], FIELDS), np.uint32)
    rows[:, 0] = wide[:, _rans.XMAX] - np.uint64(1)
    rows[:, 1] = wide[:, _rans.RCP]
    rows[:, 2] = wide[:, _rans.SHIFT]
    rows[:, 3] = wide[:, _rans.START] | (wide[:, _rans.CMPL] << np.uint64(16))
    return rows


def _pack_controls() -> np.ndarray:
    """``_simd.pshufb`` controls, 16 bytes for each 8-bit mask of renormalising lanes: the
    16-bit words of those lanes, in lane order, moved to the top of the register."""
    controls = np.full((256, 16), 0x80, np.uint8)  # 0x80: a zero byte (never kept)
    for mask in range(256):
        lanes = [k for k in range(STATES) if mask >> k & 1]
        for slot, lane in enumerate(lanes, start=STATES - len(lanes)):
            controls[mask, 2 * slot:2 * slot + 2] = (2 * lane, 2 * lane + 1)
    return controls.ravel()


_CONTROLS = _pack_controls()

def _transpose(builder: ir.IRBuilder, rows: list[Any]) -> list[Any]:
    """Eight ``<4 x i32>`` rows into the four ``<8 x i32>`` columns, by in-lane unpacks
    only (rows ``k`` and ``k + 4`` share a register): 4 inserts and 8 unpacks."""
    t = [_simd.shuffle(builder, rows[k], rows[k + 4], list(range(8))) for k in range(4)]
    lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    u0, u1 = _simd.shuffle(builder, t[0], t[1], lo32), _simd.shuffle(builder, t[0], t[1], hi32)
    u2, u3 = _simd.shuffle(builder, t[2], t[3], lo32), _simd.shuffle(builder, t[2], t[3], hi32)
    return [_simd.shuffle(builder, u0, u2, lo64), _simd.shuffle(builder, u0, u2, hi64),
            _simd.shuffle(builder, u1, u3, lo64), _simd.shuffle(builder, u1, u3, hi64)]


def _divide(builder: ir.IRBuilder, x: Any, rcp: Any, shift: Any) -> Any:
    """``(x + mulhi(x, rcp)) >> shift`` per 32-bit lane. The sum can take 33 bits, so it
    is formed in 64-bit lanes: the even lanes, then the odd ones (``vpmuludq`` each)."""
    low, s32 = _simd.splat(_simd.V4X64, 0xFFFFFFFF), _simd.splat(_simd.V4X64, 32)
    x, rcp, shift = (builder.bitcast(a, _simd.V4X64) for a in (x, rcp, shift))
    halves = []
    for part in (lambda a: builder.and_(a, low), lambda a: builder.lshr(a, s32)):
        xh = part(x)
        hi = builder.lshr(builder.mul(xh, part(rcp)), s32)
        halves.append(builder.lshr(builder.add(xh, hi), part(shift)))
    return builder.bitcast(builder.or_(halves[0], builder.shl(halves[1], s32)), _simd.V8X32)


def _rows(builder: ir.IRBuilder, symbols: Any, first: Any, base: Any, signed: bool,
          table: Any) -> list[Any]:
    """The rows of symbols ``first .. first + 7``, at ``table + 4 (v - base)``."""
    rows = []
    for k in range(STATES):
        v = builder.load(builder.gep(symbols, [builder.add(first, _simd.const(k))]))
        r = builder.sext(v, _simd.I64) if signed else builder.zext(v, _simd.I64)
        r = r if base is None else builder.sub(r, base)
        row = builder.gep(table, [builder.shl(r, _simd.const(2))])
        rows.append(builder.load(builder.bitcast(row, _simd.V4X32.as_pointer()), align=4))
    return rows


def _block(builder: ir.IRBuilder, x: Any, pos: Any, rows: list[Any], controls: Any,
           out: Any) -> tuple[Any, Any]:
    """One block of eight symbols: renormalise (write the words), then encode."""
    xm1, rcp, shift, start_cmpl = _transpose(builder, rows)
    big = builder.icmp_unsigned(">", x, xm1)
    mask = _simd.lane_mask(builder, big)
    words = builder.bitcast(builder.trunc(x, _simd.V8X16), _simd.V16X8)
    packed = _simd.pshufb(builder, words, _simd.control_row(builder, controls, mask, _simd.V16X8))
    dst = builder.gep(out, [builder.sub(pos, _simd.const(STATES))])
    builder.store(packed, builder.bitcast(dst, _simd.V16X8.as_pointer()), align=1)
    pos = builder.sub(pos, _simd.popcount(builder, mask))
    x = builder.select(big, builder.lshr(x, _simd.splat(_simd.V8X32, 16)), x)
    q = _divide(builder, x, rcp, shift)
    start = builder.and_(start_cmpl, _simd.splat(_simd.V8X32, 0xFFFF))
    cmpl = builder.lshr(start_cmpl, _simd.splat(_simd.V8X32, 16))
    return builder.add(builder.add(x, start), builder.mul(q, cmpl)), pos


@intrinsic
def _encode_blocks(typingctx: Any, v: Any, base: Any, blocks: Any, table: Any, controls: Any,
                   out: Any, pos: Any, xs: Any) -> Any:
    """Encode blocks ``blocks - 1`` down to 0 of ``v`` (symbols ``8b .. 8b + 7``) into
    the eight uint32 states ``xs`` (updated), writing words below ``out[pos]``; returns
    the new ``pos``. ``base`` None: ``v`` is uint8 and indexes ``table`` directly."""
    if not (_simd.contiguous(v, table, controls, out, xs) and isinstance(v.dtype, types.Integer)
            and isinstance(base, (types.NoneType, types.Integer))):
        return None
    sig = types.uint64(v, base, blocks, table, controls, out, pos, xs)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        def pointer(k: int, element: Any) -> Any:
            return _simd.data(context, builder, sig.args[k], args[k], element)

        symbols = pointer(0, context.get_value_type(v.dtype))
        table_p, controls_p = pointer(3, _simd.I32), pointer(4, _simd.I8)
        out_p, xs_p = pointer(5, _simd.I16), pointer(7, _simd.V8X32)
        base_v = (None if isinstance(sig.args[1], types.NoneType)
                  else context.cast(builder, args[1], sig.args[1], types.int64))
        count = context.cast(builder, args[2], sig.args[2], types.uint64)
        pos0 = context.cast(builder, args[6], sig.args[6], types.uint64)
        entry, x0 = builder.block, builder.load(xs_p, align=4)
        head = builder.append_basic_block("rans_head")
        body = builder.append_basic_block("rans_body")
        done = builder.append_basic_block("rans_done")
        builder.branch(head)
        builder.position_at_end(head)
        b, x, pos = builder.phi(_simd.I64), builder.phi(_simd.V8X32), builder.phi(_simd.I64)
        for phi, value in ((b, count), (x, x0), (pos, pos0)):
            phi.add_incoming(value, entry)
        builder.cbranch(builder.icmp_unsigned("!=", b, _simd.const(0)), body, done)
        builder.position_at_end(body)
        b_next = builder.sub(b, _simd.const(1))
        rows = _rows(builder, symbols, builder.shl(b_next, _simd.const(3)), base_v,
                     v.dtype.signed, table_p)
        x_next, pos_next = _block(builder, x, pos, rows, controls_p, out_p)
        for phi, value in ((b, b_next), (x, x_next), (pos, pos_next)):
            phi.add_incoming(value, builder.block)
        builder.branch(head)
        builder.position_at_end(done)
        builder.store(x, xs_p, align=4)
        return pos
    return sig, codegen


_LOW16 = np.uint64(0xFFFF)


@njit(cache=True, nogil=True)
def _step(x, table, r, out, pos):
    """One symbol (row ``r``) the scalar way, on the 4-word rows: the tail's steps."""
    r = r * np.uint64(FIELDS)
    big = x > np.uint64(table[r])
    out[pos - np.uint64(1)] = np.uint16(x & _LOW16)
    pos -= np.uint64(big)
    x = (x >> np.uint64(16)) if big else x
    q = (x + ((x * np.uint64(table[r + np.uint64(1)])) >> np.uint64(32))) >> np.uint64(
        table[r + np.uint64(2)])
    start_cmpl = np.uint64(table[r + np.uint64(3)])
    return x + (start_cmpl & _LOW16) + q * (start_cmpl >> np.uint64(16)), pos


@njit(cache=True, nogil=True)
def _encode(v, base, table, controls, out, end):
    n = v.size
    pos = np.uint64(end)
    xs = np.full(STATES, np.uint32(_rans.L))
    for j in range(n - 1, n - n % STATES - 1, -1):  # the tail: states 0..n%8-1
        if base is None:
            r = np.uint64(v[j])
        else:
            r = np.uint64(np.int64(v[j]) - base)
        x, pos = _step(np.uint64(xs[j % STATES]), table, r, out, pos)
        xs[j % STATES] = np.uint32(x)
    pos = _encode_blocks(v, base, np.uint64(n // STATES), table, controls, out, pos, xs)
    for k in range(STATES - 1, -1, -1):  # the final states lead the code
        out[pos - np.uint64(1)] = np.uint16(xs[k] & np.uint32(0xFFFF))
        out[pos - np.uint64(2)] = np.uint16(xs[k] >> np.uint32(16))
        pos -= np.uint64(2)
    return np.int64(pos)


def encode(v: np.ndarray, base: int | None, table: np.ndarray, out: np.ndarray,
           end: int) -> int:
    """``_rans.encode`` with the vector kernel: the same contract and the same words.

    ``table`` is ``encoder_table(...).ravel()`` (rows indexed by ``v - base``, or by the
    bytes of a uint8 ``v`` when ``base`` is None). Writes nothing outside
    ``out[begin:end]``: a block's 16-byte store ends at the write position, and the
    final states cover the last one's spare bytes."""
    return _encode(np.ascontiguousarray(v), base, table, _CONTROLS, out, end)


@njit(cache=True, nogil=True)
def _encode_chunks(v, base, table, controls, chunk, out):
    sizes = np.empty(-(-v.size // chunk), np.int64)
    end = out.size
    for c in range(sizes.size - 1, -1, -1):  # backwards: the chunks' codes end up in order
        begin = _encode(v[c * chunk:(c + 1) * chunk], base, table, controls, out, end)
        sizes[c] = end - begin
        end = begin
    return end, sizes


def encode_chunks(v: np.ndarray, base: int | None, table: np.ndarray, chunk: int,
                  out: np.ndarray) -> tuple[int, list[int]]:
    """``_rans.encode_chunks`` with the vector kernel, the chunk loop compiled too."""
    begin, sizes = _encode_chunks(np.ascontiguousarray(v), base, table, _CONTROLS, chunk, out)
    return int(begin), sizes.tolist()
