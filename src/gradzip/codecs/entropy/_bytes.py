"""Unaligned big-endian loads and stores for the numba bit-stream kernels.

A bit reader wants the 64 stream bits at any byte position as one word, and a bit
writer wants to store 32 bits at any byte position. Written as eight byte loads (or
four byte stores) and shifts, numba's LLVM did not merge them: the Exp-Golomb decoder
spent about five instructions a symbol assembling its window. These intrinsics emit
one unaligned load or store and, on little-endian hosts, a byte swap (``bswap`` or
``movbe`` on x86). Like every numba array access they check no bounds: the callers keep
their positions in range.
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
