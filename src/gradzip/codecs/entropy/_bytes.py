"""Unaligned loads and stores, and bit counts, for the numba bit-stream kernels.

A bit reader wants the 64 stream bits at any byte position as one word, and a bit
writer wants to store 32 bits at any byte position. Written as eight byte loads (or
four byte stores) and shifts, numba's LLVM did not merge them: the Exp-Golomb decoder
spent about five instructions a symbol assembling its window. These intrinsics emit
one unaligned load or store and, on little-endian hosts, a byte swap (``bswap`` or
``movbe`` on x86). Like every numba array access they check no bounds: the callers keep
their positions in range. The Huffman coder's streams are little-endian (``load64``,
``store64``, ``store32``: no swap on little-endian hosts), and its decoder tables need
``popcount`` and ``leading_zeros`` (LLVM's ``ctpop`` and ``ctlz``).
"""

from __future__ import annotations

import sys
from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _is_bytes(buf: Any, index: Any) -> bool:
    return (isinstance(buf, types.Array) and buf.dtype == types.uint8
            and isinstance(index, types.Integer))


def _big_endian(builder: Any, value: Any) -> Any:
    """A native integer reordered to (or from) big-endian byte order."""
    return builder.bswap(value) if sys.byteorder == "little" else value


def _little_endian(builder: Any, value: Any) -> Any:
    """A native integer reordered to (or from) little-endian byte order."""
    return builder.bswap(value) if sys.byteorder == "big" else value


def _pointer(context: Any, builder: Any, sig: Any, args: Any, bits: int) -> Any:
    """``&buf[index]`` as a pointer to a ``bits``-wide integer."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], sig.args[1], types.intp)
    return builder.bitcast(builder.gep(ary.data, [index]), ir.IntType(bits).as_pointer())


@intrinsic
def load_be64(typingctx: Any, buf: Any, index: Any) -> Any:
    """``buf[index:index + 8]`` (uint8) read as a big-endian uint64."""
    if not _is_bytes(buf, index):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        word = builder.load(_pointer(context, builder, sig, args, 64), align=1)
        return _big_endian(builder, word)
    return types.uint64(buf, index), codegen


@intrinsic
def store_be32(typingctx: Any, buf: Any, index: Any, value: Any) -> Any:
    """The low 32 bits of ``value`` written big-endian to ``buf[index:index + 4]``."""
    if not _is_bytes(buf, index) or not isinstance(value, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        word = context.cast(builder, args[2], sig.args[2], types.uint64)
        word = builder.trunc(word, ir.IntType(32))
        builder.store(_big_endian(builder, word), _pointer(context, builder, sig, args, 32),
                      align=1)
        return context.get_dummy_value()
    return types.none(buf, index, value), codegen


@intrinsic
def load64(typingctx: Any, buf: Any, index: Any) -> Any:
    """``buf[index:index + 8]`` (uint8) read as a little-endian int64."""
    if not _is_bytes(buf, index):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        word = builder.load(_pointer(context, builder, sig, args, 64), align=1)
        return _little_endian(builder, word)
    return types.int64(buf, index), codegen


def _store_le(bits: int) -> Any:
    def typer(typingctx: Any, buf: Any, index: Any, value: Any) -> Any:
        if not _is_bytes(buf, index) or not isinstance(value, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            word = context.cast(builder, args[2], sig.args[2], types.int64)
            if bits < 64:
                word = builder.trunc(word, ir.IntType(bits))
            builder.store(_little_endian(builder, word),
                          _pointer(context, builder, sig, args, bits), align=1)
            return context.get_dummy_value()
        return types.none(buf, index, value), codegen
    return typer


store64 = intrinsic(_store_le(64))
store64.__doc__ = "``value`` written little-endian to ``buf[index:index + 8]``."
store32 = intrinsic(_store_le(32))
store32.__doc__ = "The low 32 bits of ``value`` written little-endian to ``buf[index:index + 4]``."


def _bit_count(name: str) -> Any:
    def typer(typingctx: Any, value: Any) -> Any:
        if not isinstance(value, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            x = context.cast(builder, args[0], sig.args[0], types.int64)
            i64 = ir.IntType(64)
            if name == "llvm.ctlz":  # its second operand: is 0 poison? (no)
                fn = builder.module.declare_intrinsic(name, [i64, ir.IntType(1)])
                return builder.call(fn, [x, ir.Constant(ir.IntType(1), 0)])
            return builder.call(builder.module.declare_intrinsic(name, [i64]), [x])
        return types.int64(value), codegen
    return typer


popcount = intrinsic(_bit_count("llvm.ctpop"))
popcount.__doc__ = "The number of set bits of an integer (as 64 bits)."
leading_zeros = intrinsic(_bit_count("llvm.ctlz"))
leading_zeros.__doc__ = "The number of leading zero bits of an integer as 64 bits (64 for 0)."
