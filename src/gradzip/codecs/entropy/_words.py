"""Machine-word operations numba lacks: unaligned little-endian loads and stores, bit counts.

Loads and stores: 64/32-bit words at any byte offset of a uint8 array.
numba indexes arrays element by element, and eight byte loads shifted together are not
always fused into one load; these intrinsics are one ``load``/``store`` with alignment 1
(what x86 and ARM64 do natively), byte-swapped on a big-endian host. No bounds checks:
callers keep ``at + 8`` (or ``+ 4``) within the array. Bit counts: LLVM's ``ctpop``
and ``ctlz``, one instruction each where the CPU has them.
"""

from __future__ import annotations

import sys
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I1, _I32, _I64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)
_BIG_ENDIAN = sys.byteorder == "big"


def _byte_pointer(context: Any, builder: ir.IRBuilder, ty: Any, array: Any, at: Any,
                  word: ir.IntType) -> Any:
    data = context.make_array(ty)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [at]), word.as_pointer())


def _swap(builder: ir.IRBuilder, value: Any) -> Any:
    if not _BIG_ENDIAN:
        return value
    return builder.call(builder.module.declare_intrinsic("llvm.bswap", [value.type]), [value])


def _is_bytes(array: Any) -> bool:
    return isinstance(array, types.Array) and array.layout == "C" and array.dtype == types.uint8


@intrinsic
def load64(typingctx: Any, array: Any, at: Any) -> Any:
    """The eight bytes ``array[at:at + 8]`` as a little-endian int64."""
    if not (_is_bytes(array) and isinstance(at, types.Integer)):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        index = context.cast(builder, args[1], sig.args[1], types.int64)
        pointer = _byte_pointer(context, builder, sig.args[0], args[0], index, _I64)
        return _swap(builder, builder.load(pointer, align=1))

    return types.int64(array, at), codegen


def _store(word: ir.IntType) -> Any:
    def typer(typingctx: Any, array: Any, at: Any, value: Any) -> Any:
        if not (_is_bytes(array) and isinstance(at, types.Integer)
                and isinstance(value, types.Integer)):
            return None

        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
            index = context.cast(builder, args[1], sig.args[1], types.int64)
            pointer = _byte_pointer(context, builder, sig.args[0], args[0], index, word)
            value = context.cast(builder, args[2], sig.args[2], types.int64)
            builder.store(_swap(builder, builder.trunc(value, word) if word != _I64 else value),
                          pointer, align=1)
            return cgutils.get_null_value(context.get_value_type(types.none))

        return types.none(array, at, value), codegen

    return typer


store64 = intrinsic(_store(_I64))
store64.__doc__ = "Writes the int ``value`` to ``array[at:at + 8]``, little-endian."
store32 = intrinsic(_store(_I32))
store32.__doc__ = "Writes the low 32 bits of ``value`` to ``array[at:at + 4]``, little-endian."


def _bit_count(name: str) -> Any:
    def typer(typingctx: Any, value: Any) -> Any:
        if not isinstance(value, types.Integer):
            return None

        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
            x = context.cast(builder, args[0], sig.args[0], types.int64)
            if name == "llvm.ctlz":  # its second operand: is 0 poison? (no)
                fn = builder.module.declare_intrinsic(name, [_I64, _I1])
                return builder.call(fn, [x, ir.Constant(_I1, 0)])
            return builder.call(builder.module.declare_intrinsic(name, [_I64]), [x])

        return types.int64(value), codegen

    return typer


popcount = intrinsic(_bit_count("llvm.ctpop"))
popcount.__doc__ = "The number of set bits of an integer (as 64 bits)."
leading_zeros = intrinsic(_bit_count("llvm.ctlz"))
leading_zeros.__doc__ = "The number of leading zero bits of an integer as 64 bits (64 for 0)."
