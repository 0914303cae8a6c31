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

import platform
from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import config, njit, types
from numba.extending import intrinsic

from gradzip.codecs.entropy import _rans

STATES = _rans.STATES
FIELDS = 4  # uint32 words a row: x_max - 1, reciprocal, shift, start | cmpl << 16


def _host_has_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64") or config.CPU_NAME:
        return False  # another target (NUMBA_CPU_NAME) may lack the byte shuffle
    features = binding.get_host_cpu_features()
    return bool(features.get("avx2")) and bool(features.get("ssse3"))


#: whether this host runs the vector encoder (else ``_rans.encode`` codes the streams)
AVAILABLE = _host_has_avx2()


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
    """``pshufb`` controls, 16 bytes for each 8-bit mask of renormalising lanes: the
    16-bit words of those lanes, in lane order, moved to the top of the register."""
    controls = np.full((256, 16), 0x80, np.uint8)  # 0x80: a zero byte (never kept)
    for mask in range(256):
        lanes = [k for k in range(STATES) if mask >> k & 1]
        for slot, lane in enumerate(lanes, start=STATES - len(lanes)):
            controls[mask, 2 * slot:2 * slot + 2] = (2 * lane, 2 * lane + 1)
    return controls.ravel()


_CONTROLS = _pack_controls()

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V8X32, _V4X64 = ir.VectorType(_I32, 8), ir.VectorType(_I64, 4)
_V8X16, _V16X8, _V4X32 = ir.VectorType(_I16, 8), ir.VectorType(_I8, 16), ir.VectorType(_I32, 4)


def _splat(ty: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)


def _shuffle(builder: ir.IRBuilder, a: Any, b: Any, lanes: list[int]) -> Any:
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


def _transpose(builder: ir.IRBuilder, rows: list[Any]) -> list[Any]:
    """Eight ``<4 x i32>`` rows into the four ``<8 x i32>`` columns, by in-lane unpacks
    only (rows ``k`` and ``k + 4`` share a register): 4 inserts and 8 unpacks."""
    t = [_shuffle(builder, rows[k], rows[k + 4], list(range(8))) for k in range(4)]
    lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    u0, u1 = _shuffle(builder, t[0], t[1], lo32), _shuffle(builder, t[0], t[1], hi32)
    u2, u3 = _shuffle(builder, t[2], t[3], lo32), _shuffle(builder, t[2], t[3], hi32)
    return [_shuffle(builder, u0, u2, lo64), _shuffle(builder, u0, u2, hi64),
            _shuffle(builder, u1, u3, lo64), _shuffle(builder, u1, u3, hi64)]


def _divide(builder: ir.IRBuilder, x: Any, rcp: Any, shift: Any) -> Any:
    """``(x + mulhi(x, rcp)) >> shift`` per 32-bit lane. The sum can take 33 bits, so it
    is formed in 64-bit lanes: the even lanes, then the odd ones (``vpmuludq`` each)."""
    low, s32 = _splat(_V4X64, 0xFFFFFFFF), _splat(_V4X64, 32)
    x, rcp, shift = (builder.bitcast(a, _V4X64) for a in (x, rcp, shift))
    halves = []
    for part in (lambda a: builder.and_(a, low), lambda a: builder.lshr(a, s32)):
        xh = part(x)
        hi = builder.lshr(builder.mul(xh, part(rcp)), s32)
        halves.append(builder.lshr(builder.add(xh, hi), part(shift)))
    return builder.bitcast(builder.or_(halves[0], builder.shl(halves[1], s32)), _V8X32)


def _row_pointers(builder: ir.IRBuilder, symbols: Any, first: Any, base: Any, signed: bool,
                  table: Any) -> list[Any]:
    """Addresses of the rows of symbols ``first .. first + 7``: ``table + 4 (v - base)``."""
    pointers = []
    for k in range(STATES):
        v = builder.load(builder.gep(symbols, [builder.add(first, ir.Constant(_I64, k))]))
        r = builder.sext(v, _I64) if signed else builder.zext(v, _I64)
        r = r if base is None else builder.sub(r, base)
        row = builder.gep(table, [builder.shl(r, ir.Constant(_I64, 2))])
        pointers.append(builder.bitcast(row, _V4X32.as_pointer()))
    return pointers


def _block(builder: ir.IRBuilder, x: Any, pos: Any, rows: list[Any], controls: Any,
           out: Any) -> tuple[Any, Any]:
    """One block of eight symbols: renormalise (write the words), then encode."""
    xm1, rcp, shift, start_cmpl = _transpose(builder, rows)
    big = builder.icmp_unsigned(">", x, xm1)
    mask = builder.zext(builder.bitcast(big, _I8), _I64)
    words = builder.bitcast(builder.trunc(x, _V8X16), _V16X8)
    control = builder.load(builder.bitcast(
        builder.gep(controls, [builder.shl(mask, ir.Constant(_I64, 4))]), _V16X8.as_pointer()),
        align=1)
    pshufb = builder.module.declare_intrinsic(
        "llvm.x86.ssse3.pshuf.b.128", fnty=ir.FunctionType(_V16X8, [_V16X8, _V16X8]))
    dst = builder.gep(out, [builder.sub(pos, ir.Constant(_I64, STATES))])
    builder.store(builder.call(pshufb, [words, control]),
                  builder.bitcast(dst, _V16X8.as_pointer()), align=1)
    popcount = builder.module.declare_intrinsic("llvm.ctpop", [_I64])
    pos = builder.sub(pos, builder.call(popcount, [mask]))
    x = builder.select(big, builder.lshr(x, _splat(_V8X32, 16)), x)
    q = _divide(builder, x, rcp, shift)
    start = builder.and_(start_cmpl, _splat(_V8X32, 0xFFFF))
    cmpl = builder.lshr(start_cmpl, _splat(_V8X32, 16))
    return builder.add(builder.add(x, start), builder.mul(q, cmpl)), pos


def _contiguous(*arrays: Any) -> bool:
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)


@intrinsic
def _encode_blocks(typingctx: Any, v: Any, base: Any, blocks: Any, table: Any, controls: Any,
                   out: Any, pos: Any, xs: Any) -> Any:
    """Encode blocks ``blocks - 1`` down to 0 of ``v`` (symbols ``8b .. 8b + 7``) into
    the eight uint32 states ``xs`` (updated), writing words below ``out[pos]``; returns
    the new ``pos``. ``base`` None: ``v`` is uint8 and indexes ``table`` directly."""
    if not (_contiguous(v, table, controls, out, xs) and isinstance(v.dtype, types.Integer)
            and isinstance(base, (types.NoneType, types.Integer))):
        return None
    sig = types.uint64(v, base, blocks, table, controls, out, pos, xs)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        data = [context.make_array(sig.args[k])(context, builder, args[k]).data
                for k in (0, 3, 4, 5, 7)]
        symbols, table_p, controls_p, out_p, xs_p = data
        table_p = builder.bitcast(table_p, _I32.as_pointer())
        controls_p = builder.bitcast(controls_p, _I8.as_pointer())
        out_p = builder.bitcast(out_p, _I16.as_pointer())
        xs_p = builder.bitcast(xs_p, _V8X32.as_pointer())
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
        b, x, pos = builder.phi(_I64), builder.phi(_V8X32), builder.phi(_I64)
        for phi, value in ((b, count), (x, x0), (pos, pos0)):
            phi.add_incoming(value, entry)
        builder.cbranch(builder.icmp_unsigned("!=", b, ir.Constant(_I64, 0)), body, done)
        builder.position_at_end(body)
        b_next = builder.sub(b, ir.Constant(_I64, 1))
        first = builder.shl(b_next, ir.Constant(_I64, 3))
        pointers = _row_pointers(builder, symbols, first, base_v, sig.args[0].dtype.signed,
                                 table_p)
        rows = [builder.load(p, align=4) for p in pointers]
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
