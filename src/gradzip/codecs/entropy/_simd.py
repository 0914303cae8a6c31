"""LLVM IR pieces for the numba intrinsics of the vector rANS coders.

numba has no vector types, so the vector loops of ``_rans_vector`` (encoder) and
``_rans_vector_decode`` (decoder) are written as LLVM IR inside ``@intrinsic``s. Most
of it is portable IR (LLVM picks the instructions); the byte shuffle (``pshufb``) that
packs or spreads the 16-bit renormalisation words by a lane mask is x86's, so the vector
coders run only where ``AVAILABLE`` and the scalar ones (``_rans``) elsewhere. Both
write and read the same words.
"""

from __future__ import annotations

import platform
from typing import Any

from llvmlite import binding, ir
from numba import config, types

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V8X32, V4X64, V4X32 = ir.VectorType(I32, 8), ir.VectorType(I64, 4), ir.VectorType(I32, 4)
V8X16, V16X8, V32X8 = ir.VectorType(I16, 8), ir.VectorType(I8, 16), ir.VectorType(I8, 32)


def _host_has_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64") or getattr(config, "CPU_NAME", None):
        return False  # another target (NUMBA_CPU_NAME) may lack the byte shuffle
    features = binding.get_host_cpu_features()
    return bool(features.get("avx2")) and bool(features.get("ssse3"))


#: whether this host runs the vector coders (x86-64 with AVX2, numba targeting the host)
AVAILABLE = _host_has_avx2()


def const(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def splat(ty: ir.VectorType, value: int) -> ir.Constant:
    """``value`` in every lane of ``ty``."""
    return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)


def shuffle(builder: ir.IRBuilder, a: Any, b: Any, lanes: list[int]) -> Any:
    """Lanes of ``a`` then ``b`` (numbered on from ``a``'s) in the order given."""
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(lanes)), lanes))


def pshufb(builder: ir.IRBuilder, data: Any, control: Any) -> Any:
    """x86's byte shuffle of 16 bytes (SSSE3) or of each 16-byte half of 32 (AVX2)."""
    name, ty = (("llvm.x86.ssse3.pshuf.b.128", V16X8) if data.type == V16X8
                else ("llvm.x86.avx2.pshuf.b", V32X8))
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ty, [ty, ty]))
    return builder.call(fn, [data, control])


def popcount(builder: ir.IRBuilder, value: Any) -> Any:
    return builder.call(builder.module.declare_intrinsic("llvm.ctpop", [value.type]), [value])


def lane_mask(builder: ir.IRBuilder, lanes: Any) -> Any:
    """An ``<8 x i1>`` comparison as an i64 bit mask (lane k in bit k: ``vmovmskps``)."""
    return builder.zext(builder.bitcast(lanes, I8), I64)


def control_row(builder: ir.IRBuilder, controls: Any, mask: Any, ty: ir.VectorType) -> Any:
    """Row ``mask`` of a table of ``pshufb`` controls of type ``ty``."""
    size = ty.count * ty.element.width // 8
    row = builder.gep(controls, [builder.mul(mask, const(size))])
    return builder.load(builder.bitcast(row, ty.as_pointer()), align=1)


def data(context: Any, builder: ir.IRBuilder, ty: Any, value: Any, element: Any) -> Any:
    """The data pointer of numba array ``value`` (type ``ty``) as ``element*``."""
    return builder.bitcast(context.make_array(ty)(context, builder, value).data,
                           element.as_pointer())


def contiguous(*arrays: Any) -> bool:
    """Whether every numba type given is a C-contiguous array (the intrinsics index
    their raw data)."""
    return all(isinstance(a, types.Array) and a.layout == "C" for a in arrays)
