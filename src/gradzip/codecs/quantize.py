"""Quantizers: ``int8``, ``qsgd``, ``natural`` and ``terngrad``.

Each keeps one scale per block of values (or per tensor) and sends small integers,
so a later lossless stage (Exp-Golomb, ANS) can code the integer fields further.

Speed: a 16M-value fp32 tensor has to be encoded and decoded in well under a
second on one core, so the work runs over cache-sized chunks of ``_CHUNK`` values
with one reused scratch buffer (a fresh 64 MB temporary costs ~40 ms in page
faults alone here), and randomness comes from numpy's SFC64 bit generator, which
makes 16-bit uniforms ~10x faster than ``torch.rand`` makes floats.

Stochastic rounding ``floor(y + u)`` uses ``u = (r + 1/2) / 2**16`` with ``r`` a
uniform 16-bit integer, so the probability of rounding up is the fractional part
of ``y`` to within 2**-17: the bias is below 2**-17 of one quantization step,
far under the sampling noise of any test or training run (``torch.rand`` itself
has only 24 random bits).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gradzip.codecs import kernels
from gradzip.codecs.base import Compressor, Shapes, Slot
from gradzip.codecs.bitpack import (
    lut_decode,
    pack_trits,
    packed_trits_len,
    trits_to_values,
    unpack_trits,
)
from gradzip.codecs.kernels.blocks import block_table
from gradzip.codecs.layout import (
    Layout,
    block_stats,
    scale_pieces,
    spread,
    tensor_layout,
    uniform_layout,
)
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, SpecError, at_least, in_range, register
from gradzip.collectives.communicator import Communicator
from gradzip.collectives.linkmodel import link_bytes
from gradzip.collectives.upload import device_tensor

#: values per chunk of work: 512 KB of fp32, inside this machine's 1 MB L2 per core
#: (measured: 2^17 beats 2^16 by ~15% and 2^14 by ~2x on the 16M-value benchmark)
_CHUNK = 1 << 17
_FP32_MAX = float(torch.finfo(torch.float32).max)


# ---------------------------------------------------------------- randomness
class RandomBits:
    """Uniform random integers for one encode call, drawn chunk by chunk.

    Seeded from the slot's private (per-rank) seed, so encodes are reproducible
    and ranks round independently. CPU uses numpy's SFC64; other devices torch.
    """

    def __init__(self, slot: Slot, device: torch.device) -> None:
        self.device = device
        #: the slot's private seed (the fused kernels draw from it on the device)
        self.seed = seed = slot.seed(shared=False)
        if device.type == "cpu":
            self._np: np.random.Generator | None = np.random.Generator(np.random.SFC64(seed))
        else:
            self._np = None
            # a meta tensor has no values to round (the device-discipline tests run
            # codecs on meta): draw without a generator there
            self._torch: torch.Generator | None = None
            if device.type != "meta":
                self._torch = torch.Generator(device=device)
                self._torch.manual_seed(seed)

    def _raw(self, k: int, dtype: np.dtype, tdtype: torch.dtype) -> torch.Tensor:
        if self._np is not None:
            per = 8 // np.dtype(dtype).itemsize
            raw = self._np.bit_generator.random_raw((k + per - 1) // per)
            return torch.from_numpy(raw.view(dtype)[:k])
        info = torch.iinfo(tdtype)
        return torch.randint(info.min, info.max + 1, (k,), dtype=tdtype,
                             generator=self._torch, device=self.device)

    def int16(self, k: int) -> torch.Tensor:
        """``k`` uniform int16 values (16 random bits each)."""
        return self._raw(k, np.dtype(np.int16), torch.int16)

    def int32(self, k: int) -> torch.Tensor:
        """``k`` uniform int32 values (32 random bits each)."""
        return self._raw(k, np.dtype(np.int32), torch.int32)

    def uniform(self, k: int) -> torch.Tensor:
        """``k`` float64 uniforms in [0, 1) (for rare, small subsets)."""
        if self._np is not None:
            return torch.from_numpy(self._np.random(k))
        return torch.rand(k, dtype=torch.float64, generator=self._torch, device=self.device)


# ---------------------------------------------------------------- block kernels
def block_stat(
    x: torch.Tensor, block: int, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``fn`` applied to each row of ``x`` cut into blocks (the last may be short)."""
    n = x.numel()
    m = (n // block) * block
    parts = []
    if m:
        parts.append(fn(x[:m].view(-1, block)))
    if n > m:
        parts.append(fn(x[m:].view(1, -1)))
    if not parts:
        return x.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts).float()


def _absmax(v: torch.Tensor) -> torch.Tensor:
    # amax and amin separately are ~4x faster than aminmax(dim=1) or abs().amax() here
    return torch.maximum(v.amax(1), v.amin(1).neg())


def _l2(v: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(v, dim=1)


def quantize_blocks(
    x: torch.Tensor,
    block: int,
    inv: torch.Tensor,
    levels: int,
    dtype: torch.dtype,
    rand: RandomBits | None,
    clip: bool = False,
) -> torch.Tensor:
    """``quantize_layout`` over one tensor cut into blocks of ``block`` values."""
    return quantize_layout(x, uniform_layout(x.numel(), block), inv, levels, dtype, rand, clip)


def quantize_layout(
    x: torch.Tensor,
    layout: Layout,
    inv: torch.Tensor,
    levels: int,
    dtype: torch.dtype,
    rand: RandomBits | None,
    clip: bool = False,
) -> torch.Tensor:
    """Integers ``q`` in [-levels, levels] with ``q ~ x * inv[block]``.

    ``rand`` None: round to nearest (|error| <= 1/2 step). Otherwise unbiased
    stochastic rounding ``floor(y + u)``: E[q] = y for y in [-levels, levels].
    ``clip``: values beyond the range are clipped before rounding (TernGrad's
    clipping); without it the caller guarantees |y| <= levels up to rounding.
    """
    n = x.numel()
    out = torch.empty(n, dtype=dtype, device=x.device)
    scratch = torch.empty(layout.largest, dtype=torch.float32, device=x.device)
    for p in layout.pieces:
        start, rows, width, k = p.start, p.rows, p.width, p.size
        y = scratch[:k].view(rows, width)
        torch.mul(x[start:start + k].view(rows, width), spread(inv, p), out=y)
        if rand is None:
            y.round_()
        else:
            if clip:
                y.clamp_(-levels, levels)
            y.add_(rand.int16(k).view(rows, width), alpha=2.0**-16)
            y.add_(0.5 + 2.0**-17).floor_()
        # float rounding may leave y a hair outside the range; never wrap the integer
        y.clamp_(-levels, levels)
        out[start:start + k].view(rows, width).copy_(y)
    return out


def dequantize_blocks(q: torch.Tensor, block: int, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale[block]`` (the inverse of ``quantize_blocks``)."""
    return dequantize_layout(q, uniform_layout(q.numel(), block), scale)


def dequantize_layout(q: torch.Tensor, layout: Layout, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale[block]`` (the inverse of ``quantize_layout``)."""
    n = q.numel()
    if n != layout.n:
        raise PayloadError(f"payload has {n} values, the tensors hold {layout.n}")
    if scale.numel() != layout.nblocks:
        raise PayloadError(
            f"payload has {scale.numel()} scales for {n} values in {layout.nblocks} blocks"
        )
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    scale = scale.float().reshape(-1)
    for p in layout.pieces:
        start, k = p.start, p.size
        torch.mul(q[start:start + k].view(p.rows, p.width), spread(scale, p),
                  out=out[start:start + k].view(p.rows, p.width))
    return out


def safe_inverse(levels: float, norm: torch.Tensor) -> torch.Tensor:
    """``levels / norm`` with 0 for all-zero blocks, finite even for a denormal norm.

    For a denormal norm the fp32 inverse would overflow to inf (and 0 * inf = NaN);
    capping it at fp32's max only makes those blocks' integers smaller.
    """
    inv = (levels / norm.double()).clamp(max=_FP32_MAX).float()
    return torch.where(norm > 0, inv, torch.zeros_like(inv))


def int_dtype(levels: int) -> torch.dtype:
    """The smallest signed integer dtype that holds [-levels, levels]."""
    if levels <= 127:
        return torch.int8
    if levels <= 32767:
        return torch.int16
    return torch.int32


def _check_numel(t: torch.Tensor, shape: torch.Size, what: str) -> None:
    if t.numel() != shape.numel():
        raise PayloadError(
            f"{what} holds {t.numel()} values, shape {tuple(shape)} needs {shape.numel()}"
        )


def numels(shapes: Shapes) -> list[int]:
    """The number of values of each tensor in a bucket."""
    return [torch.Size(s).numel() for s in shapes]


def kernel_quantize(x: torch.Tensor, sizes: list[int], block: int, levels: int,
                    dtype: torch.dtype, rand: RandomBits | None, l2: bool = False,
                    as_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(integers, float32 per block: the L2 norm (``l2``), else the abs-max, or that
    over ``levels`` with ``as_scale``) from the fused kernel (``kernels.quant``) where
    it runs for ``x`` (a CUDA tensor, Triton installed), else None: what the torch path
    computes, blocks restarting at every tensor of ``sizes``. Stochastic rounding
    draws on the device from the slot's seed (Philox), not from ``rand``'s stream."""
    if not kernels.runs_on(x, block):
        return None
    from gradzip.codecs.kernels import quant

    return quant.quantize(x, block_table(sizes, block, x.device), levels, dtype, l2=l2,
                          seed=rand.seed if rand is not None else None, as_scale=as_scale)


def kernel_dequantize(q: torch.Tensor, scale: torch.Tensor, sizes: list[int],
                      block: int) -> torch.Tensor | None:
    """float32 ``q * scale[block]`` from the fused kernel where it runs, else None;
    a payload whose scales do not match the blocks is refused as on the torch path."""
    if not kernels.runs_on(q, block):
        return None
    from gradzip.codecs.kernels import quant

    table = block_table(sizes, block, q.device)
    if scale.numel() != table.count:
        raise PayloadError(f"payload has {scale.numel()} scales for {q.numel()} values "
                           f"in {table.count} blocks")
    return quant.dequantize(q, table, scale.reshape(-1))


def _dequantize_tensors(q: torch.Tensor, scale: torch.Tensor, shape: torch.Size,
                        shapes: Shapes, block: int, what: str) -> torch.Tensor:
    """``q`` x its block's scale, blocks restarting at each tensor of ``shapes``."""
    _check_numel(q, shape, what)
    fused = kernel_dequantize(q.reshape(-1), scale, numels(shapes), block)
    if fused is not None:
        return fused.reshape(shape)
    layout = tensor_layout(numels(shapes), block, device=q.device)
    return dequantize_layout(q, layout, scale).reshape(shape)


# ---------------------------------------------------------------- int8
@register("int8")
class Int8(Compressor):
    """Block-wise abs-max int8: ``q = round(x * 127 / max|block|)``, one fp32 scale per block.

    Wire: ``q`` int8 (1 byte/value) + ``scale`` fp32 per block (4/block bytes/value;
    block 256 gives 1.016 bytes/value, 3.94x vs fp32). Round-to-nearest errs by at
    most scale/2 per value; ``stochastic=true`` rounds up with probability equal to
    the fractional part instead, which is unbiased (E[decode] = x).

    ``shared=narrow|wide`` makes it summable across ranks with a two-round ``reduce``:
    first all-reduce the max of each block's abs-max (fp32 per block), then quantize
    against that common scale and all-reduce the integers. Integer all-reduce wraps
    silently on overflow (gloo and NCCL), and neither has int16, so:

    * ``narrow``: each rank uses ``127 // world`` levels, so the sum of all ranks stays
      in [-127, 127] and goes as int8 (1 byte/value). Precision falls with world size
      (2 ranks: +-63, 8: +-15, 16: +-7); more than 127 ranks is an error.
    * ``wide``: each rank keeps +-127 levels and the sum goes as int32 (4 bytes/value,
      no saving over fp32): the exact reference to measure ``narrow`` against.

    A plain ``encode`` (or ``topk | int8``, which quantizes the kept values) always
    uses per-rank scales. Given a bucket's tensor shapes (``encode_tensors``), blocks
    restart at every tensor, so no block mixes two tensors' magnitudes; the
    shared-scale ``reduce`` still cuts the bucket as a whole.
    """

    fixed_layout = True

    summary = "block-wise abs-max int8 (1 byte/value + fp32 scale per block)"
    PARAMS = (
        Param("block", int, 256, "values per fp32 abs-max scale (the last block may be short)",
              at_least(1)),
        Param("stochastic", bool, False,
              "unbiased stochastic rounding instead of round-to-nearest"),
        Param("shared", str, "off",
              "common scale across ranks in reduce: off, narrow (127//world levels, int8 sums) "
              "or wide (127 levels, int32 sums)", choices=("off", "narrow", "wide")),
    )
    LEVELS = 127
    per_tensor = True

    def __init__(self, **params: object) -> None:
        super().__init__(**params)
        # per-instance flags: the chain reads them through the instance
        self.unbiased = bool(self.params["stochastic"])  # type: ignore[misc]
        self.multi_round = self.params["shared"] != "off"  # type: ignore[misc]

    def _rand(self, x: torch.Tensor, slot: Slot) -> RandomBits | None:
        return RandomBits(slot, x.device) if self.params["stochastic"] else None

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.reshape(-1).contiguous()  # a strided view too takes the kernel path
        block = self.params["block"]
        rand = self._rand(flat, slot)
        fused = kernel_quantize(flat, [flat.numel()], block, self.LEVELS, torch.int8, rand,
                                as_scale=True)
        if fused is not None:
            return Payload({"q": fused[0], "scale": fused[1]})
        amax = block_stat(flat, block, _absmax)
        q = quantize_blocks(flat, block, safe_inverse(self.LEVELS, amax), self.LEVELS,
                            torch.int8, rand)
        return Payload({"q": q, "scale": amax / self.LEVELS})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        q = p.tensor("q")
        _check_numel(q, shape, "int8 payload")
        block, scale = self.params["block"], p.tensor("scale")
        fused = kernel_dequantize(q.reshape(-1), scale, [q.numel()], block)
        if fused is not None:
            return fused.reshape(shape)
        return dequantize_blocks(q, block, scale).reshape(shape)

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """Blocks of ``block`` values restarting at each tensor; one fp32 scale per block."""
        if len(shapes) == 1:
            return self.encode(x, slot)
        flat = x.reshape(-1)
        rand = self._rand(flat, slot)
        fused = kernel_quantize(flat, numels(shapes), self.params["block"], self.LEVELS,
                                torch.int8, rand, as_scale=True)
        if fused is not None:
            return Payload({"q": fused[0], "scale": fused[1]})
        layout = tensor_layout(numels(shapes), self.params["block"], device=flat.device)
        amax = block_stats(flat, layout, "absmax").float()
        q = quantize_layout(flat, layout, safe_inverse(self.LEVELS, amax), self.LEVELS,
                            torch.int8, rand)
        return Payload({"q": q, "scale": amax / self.LEVELS})

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        if len(shapes) == 1:
            return self.decode(p, shape, slot)
        return _dequantize_tensors(p.tensor("q"), p.tensor("scale"), shape, shapes,
                                   self.params["block"], "int8 payload")

    def reduce(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shared-scale sum: all-reduce max block scales, then the integers (see class doc)."""
        world = comm.world_size
        flat = x.reshape(-1)
        block = self.params["block"]
        if self.params["shared"] == "narrow":
            levels, dtype = self.LEVELS // world, torch.int8
            if levels < 1:
                raise SpecError(
                    f"int8(shared=narrow) needs at most {self.LEVELS} ranks so the int8 sum "
                    f"cannot overflow; got {world}; use shared=wide"
                )
        else:
            levels, dtype = self.LEVELS, torch.int32
        amax = block_stat(flat, block, _absmax)
        if amax.numel():
            (amax,) = comm.all_reduce([amax], op="max")
        q = quantize_blocks(flat, block, safe_inverse(levels, amax), levels, dtype,
                            self._rand(flat, slot))
        scale = amax / levels
        local = dequantize_blocks(q, block, scale).reshape(x.shape) if want_local else None
        (total,) = comm.all_reduce([q], op="sum") if q.numel() else (q,)
        mean = dequantize_blocks(total, block, scale / world).reshape(x.shape)
        return mean, local


# ---------------------------------------------------------------- qsgd
@register("qsgd")
class QSGD(Compressor):
    """QSGD (Alistarh et al., NeurIPS 2017): unbiased stochastic rounding to s levels.

    Per bucket of ``bucket`` values with L2 norm ``||v||``, each value becomes
    ``sign(x) * l`` with ``l`` in {0..s} drawn so that E[l] = s |x| / ||v||, and
    decodes to ``||v|| / s * sign(x) * l``: unbiased, with variance at most
    ``min(d/s^2, sqrt(d)/s) ||v||^2`` (the paper's Lemma 3.1).

    Wire: ``q`` signed integers in [-s, s] in the smallest dtype that fits (int8 for
    s <= 127, then int16, int32), ``norm`` fp32 per bucket. Small integers are what
    the paper codes with Elias codes; here a following ``eg``/``ans`` stage does it.
    Given a DDP bucket's tensor shapes (``encode_tensors``), buckets of values restart
    at every tensor, so no norm mixes two tensors.
    """

    fixed_layout = True

    summary = "QSGD: per-bucket L2 norm + unbiased stochastic rounding to s levels"
    unbiased = True
    per_tensor = True
    PARAMS = (
        Param("levels", int, 16, "quantization levels s per sign: integers in [-s, s]",
              in_range(1, 2**24)),
        Param("bucket", int, 512, "values per fp32 L2-norm bucket (the last may be short)",
              at_least(1)),
    )

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.reshape(-1).contiguous()  # a strided view too takes the kernel path
        s, bucket = self.params["levels"], self.params["bucket"]
        rand = RandomBits(slot, flat.device)
        fused = kernel_quantize(flat, [flat.numel()], bucket, s, int_dtype(s), rand, l2=True)
        if fused is not None:
            return Payload({"q": fused[0], "norm": fused[1]})
        # a norm that overflowed fp32 is clamped: any norm >= max|x| keeps E[q] exact
        norm = block_stat(flat, bucket, _l2).clamp(max=_FP32_MAX)
        q = quantize_blocks(flat, bucket, safe_inverse(s, norm), s, int_dtype(s), rand)
        return Payload({"q": q, "norm": norm})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        q = p.tensor("q")
        _check_numel(q, shape, "qsgd payload")
        scale = p.tensor("norm").float() / self.params["levels"]
        fused = kernel_dequantize(q.reshape(-1), scale, [q.numel()], self.params["bucket"])
        if fused is not None:
            return fused.reshape(shape)
        return dequantize_blocks(q, self.params["bucket"], scale).reshape(shape)

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """Norm buckets restarting at each tensor; one fp32 norm per bucket."""
        if len(shapes) == 1:
            return self.encode(x, slot)
        flat = x.reshape(-1)
        s = self.params["levels"]
        rand = RandomBits(slot, flat.device)
        fused = kernel_quantize(flat, numels(shapes), self.params["bucket"], s, int_dtype(s),
                                rand, l2=True)
        if fused is not None:
            return Payload({"q": fused[0], "norm": fused[1]})
        layout = tensor_layout(numels(shapes), self.params["bucket"], device=flat.device)
        norm = block_stats(flat, layout, "sumsq").sqrt_().clamp_(max=_FP32_MAX).float()
        q = quantize_layout(flat, layout, safe_inverse(s, norm), s, int_dtype(s), rand)
        return Payload({"q": q, "norm": norm})

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        if len(shapes) == 1:
            return self.decode(p, shape, slot)
        scale = p.tensor("norm").float() / self.params["levels"]
        return _dequantize_tensors(p.tensor("q"), scale, shape, shapes,
                                   self.params["bucket"], "qsgd payload")


# ---------------------------------------------------------------- natural
@register("natural")
class Natural(Compressor):
    """Natural compression (Horváth et al., 2019): unbiased rounding to a power of two.

    A value with 2^a <= |x| < 2^(a+1) becomes 2^(a+1) with probability
    (|x| - 2^a) / 2^a and 2^a otherwise, so E = x and the variance is at most
    |x|^2 / 8. In fp32 bits that probability is exactly mantissa / 2^23, so the
    rounding is one integer compare against 23 random bits.

    Wire: ``codes`` uint8, 1 byte/value (4x vs fp32), plus the tensor's largest
    fp32 biased exponent ``emax`` in meta. Bit 7 is the sign; bits 0-6 are ``c``: 0
    means zero, ``c >= 1`` means 2^(c + base - 127) with ``base = max(emax - 126, 0)``:
    the top 127 powers of two up to 2^(emax - 126), which a rounded-up maximum can
    reach. Values below the smallest of those, m, go to m with probability |x|/m
    and to 0 otherwise (a second unbiased step after the power-of-two rounding), so
    the codec stays unbiased at every magnitude; that needs a dynamic range over
    2^126 within one tensor, so it is a rare, separate path. fp32 denormals round to
    0 or 2^-126 the same way. Only a value >= 2^127 could round up past fp32's range;
    it saturates at 2^127 (biased, and far beyond any finite-loss gradient).
    """

    summary = "natural compression: unbiased rounding to powers of two (1 byte/value)"
    unbiased = True

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.reshape(-1).contiguous()
        n = flat.numel()
        codes = torch.empty(n, dtype=torch.uint8, device=flat.device)
        if n == 0:
            return Payload({"codes": codes}, {"emax": 0})
        lo, hi = torch.aminmax(flat)
        amax = torch.maximum(hi, lo.neg()).reshape(1)
        emax = int((amax.view(torch.int32) >> 23) & 255)
        base = max(emax - 126, 0)  # code c >= 1 is biased exponent c + base
        rand = RandomBits(slot, flat.device)
        bits = flat.view(torch.int32)
        on_host = flat.device.type == "cpu"
        chunk = _CHUNK if on_host else n  # an accelerator takes the tensor in one piece
        for start in range(0, n, chunk):
            b = bits[start:start + chunk]
            k = b.numel()
            # |x| bits + 23 random bits: the mantissa carries into the exponent with
            # probability mantissa / 2^23, which is exactly the rounding-up probability
            e = (b & 0x7FFFFFFF).add_(rand.int32(k).bitwise_and_(0x7FFFFF))
            e.bitwise_right_shift_(23)
            if emax == 254:
                e.clamp_(max=254)  # 2^128 is not a float: saturate
            if base:
                # (e - 1) & 255 sends zeros to 255: a minimum below base means some
                # nonzero value rounded to a power below the kept range
                if not on_host:  # no host read: every value takes the (rare) test
                    self._tiny_everywhere(e, base, rand)
                elif int((e - 1).bitwise_and_(255).amin()) < base:
                    self._tiny(e, base, rand)
                e.sub_(base).clamp_(min=0)
            e.bitwise_or_((b >> 24).bitwise_and_(128))
            codes[start:start + k].copy_(e)
        return Payload({"codes": codes}, {"emax": emax})

    @staticmethod
    def _tiny(e: torch.Tensor, base: int, rand: RandomBits) -> None:
        """Exponents 1..base (below code 1): to base + 1 w.p. 2^(e - base - 1), else 0."""
        idx = ((e >= 1) & (e <= base)).nonzero().squeeze(1)
        prob = torch.exp2(e[idx].double() - (base + 1))
        keep = rand.uniform(idx.numel()).to(prob.device) < prob
        e[idx] = torch.where(keep, base + 1, 0).to(e.dtype)

    @staticmethod
    def _tiny_everywhere(e: torch.Tensor, base: int, rand: RandomBits) -> None:
        """``_tiny`` without its index list (whose size is a host read): the same
        probabilities for every value, in whole-tensor ops on the device."""
        tiny = (e >= 1) & (e <= base)
        prob = torch.exp2(e.double() - (base + 1))
        keep = rand.uniform(e.numel()).to(prob.device) < prob
        e.copy_(torch.where(tiny, torch.where(keep, base + 1, 0).to(e.dtype), e))

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        codes = p.tensor("codes")
        if codes.dtype != torch.uint8:
            raise PayloadError(f"natural payload codes must be uint8, got {codes.dtype}")
        _check_numel(codes, shape, "natural payload")
        base = max(p.int("emax") - 126, 0)
        c = torch.arange(128, dtype=torch.float64)
        exp = (c + base).clamp(max=254)
        mag = torch.where(c > 0, torch.exp2(exp - 127), torch.zeros_like(c))
        table = torch.cat([mag, -mag]).float()
        return lut_decode(codes.reshape(-1), table, shape.numel()).reshape(shape)


# ---------------------------------------------------------------- terngrad
@register("terngrad")
class TernGrad(Compressor):
    """TernGrad (Wen et al., NeurIPS 2017): stochastic ternary {-1, 0, 1} x one scale.

    With ``s = max|x|`` over the tensor, each value becomes ``s * sign(x) * b`` with
    ``b ~ Bernoulli(|x| / s)``: unbiased. ``clip = c > 0`` applies the paper's gradient
    clipping first: ``s = min(max|x|, c * std(x))`` and values are clipped to [-s, s]
    (the paper uses c = 2.5); that trades a small bias for much lower variance, so
    the codec then reports ``unbiased = False``.

    Wire: trits packed five to a byte in base 3 (1.6 bits/value, 20x vs fp32; two-bit
    packing would be 16x) plus ``scale`` fp32. Decoding is a 243-row table lookup.
    Given a bucket's tensor shapes (``encode_tensors``), the scale is per tensor, as
    in the paper (one fp32 per tensor on the wire).

    ``shared=true`` (default) shares the scaler across ranks as the paper does: a
    multi-round ``reduce`` first all-reduces the max of the per-tensor scales (4
    bytes per tensor), then every rank ternarizes against the shared scales, so the
    trits of all ranks are integers of one scale and simply add up. The sum goes
    whichever way the link model says is fewer bytes: an int8 all-reduce (sums in
    [-W, W]; 2(W-1)/W bytes/value) or an all-gather of the packed trits
    ((W-1) x 0.2 bytes/value), which wins below 10 ranks. ``shared=false`` keeps
    per-rank scales (the payloads are then all-gathered and decoded per rank).
    """

    fixed_layout = True

    summary = "TernGrad: stochastic ternary x max|x| (1.6 bits/value, base-3 packed)"
    unbiased = True
    per_tensor = True
    multi_round = True  # the default (shared=true); each instance sets its own
    PARAMS = (
        Param("clip", float, 0.0,
              "clip at clip * std(x) before ternarizing (paper: 2.5); 0 = no clipping",
              at_least(0.0)),
        Param("shared", bool, True,
              "share the per-tensor scales across ranks in reduce (max all-reduce), so "
              "the trits are summed; false: per-rank scales"),
    )

    def __init__(self, **params: object) -> None:
        super().__init__(**params)
        self.unbiased = self.params["clip"] == 0.0  # type: ignore[misc]
        self.multi_round = bool(self.params["shared"])  # type: ignore[misc]

    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        flat = x.reshape(-1).contiguous()  # a strided view too takes the kernel path
        n = flat.numel()
        scale = torch.zeros(1, dtype=torch.float32, device=flat.device)
        if n:
            lo, hi = torch.aminmax(flat)
            scale = torch.maximum(hi, lo.neg()).reshape(1).float()
            clip = self.params["clip"]
            if clip > 0 and n > 1:
                limit = clip * flat.std()
                if float(limit) > 0:  # a constant tensor has std 0: nothing to clip
                    scale = torch.minimum(scale, limit)
        t = quantize_blocks(flat, max(n, 1), safe_inverse(1, scale), 1, torch.int8,
                            RandomBits(slot, flat.device), clip=self.params["clip"] > 0)
        codes = t.view(torch.uint8).add_(1)  # -1, 0, 1 -> 0, 1, 2 (uint8 wraps 255 + 1)
        return Payload({"trits": pack_trits(codes), "scale": scale})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        scale = p.tensor("scale")
        if scale.numel() != 1:
            raise PayloadError(f"terngrad payload needs one scale, has {scale.numel()}")
        s = float(scale.reshape(-1)[0])
        try:
            out = trits_to_values(p.tensor("trits"), shape.numel(), (-s, 0.0, s))
        except (TypeError, ValueError) as e:
            raise PayloadError(f"terngrad payload: {e}") from None
        return out.reshape(shape)

    # ------------------------------------------------------------ per tensor
    def _scales(self, flat: torch.Tensor, layout: Layout, sizes: list[int]) -> torch.Tensor:
        """fp32 per-tensor scale: max|x|, or min(max|x|, clip * std) when clipping."""
        scale = block_stats(flat, layout, "absmax")
        clip = self.params["clip"]
        if clip > 0:
            count = device_tensor(sizes, flat.device, torch.float64)
            mean = block_stats(flat, layout, "sumpos") + block_stats(flat, layout, "sumneg")
            mean /= count.clamp(min=1)
            var = block_stats(flat, layout, "sumsq", center=mean) / (count - 1).clamp(min=1)
            limit = clip * var.sqrt()
            use = (count > 1) & (limit > 0)  # a constant tensor has std 0: nothing to clip
            scale = torch.where(use, torch.minimum(scale, limit), scale)
        return scale.float()

    def _ternarize(self, flat: torch.Tensor, layout: Layout, scale: torch.Tensor,
                   slot: Slot) -> torch.Tensor:
        """int8 trits in {-1, 0, 1}: ``scale * t`` is an unbiased estimate of ``flat``."""
        return quantize_layout(flat, layout, safe_inverse(1, scale), 1, torch.int8,
                               RandomBits(slot, flat.device), clip=self.params["clip"] > 0)

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """One scale per tensor of the bucket (``scale`` has one fp32 per tensor)."""
        if len(shapes) == 1:
            return self.encode(x, slot)
        flat = x.reshape(-1)
        sizes = numels(shapes)
        layout = tensor_layout(sizes, device=flat.device)
        scale = self._scales(flat, layout, sizes)
        codes = self._ternarize(flat, layout, scale, slot).view(torch.uint8).add_(1)
        return Payload({"trits": pack_trits(codes), "scale": scale})

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        if len(shapes) == 1:
            return self.decode(p, shape, slot)
        scale = p.tensor("scale")
        if scale.numel() != len(shapes):
            raise PayloadError(
                f"terngrad payload has {scale.numel()} scales for {len(shapes)} tensors"
            )
        try:
            unit = trits_to_values(p.tensor("trits"), shape.numel(), (-1.0, 0.0, 1.0))
        except (TypeError, ValueError) as e:
            raise PayloadError(f"terngrad payload: {e}") from None
        layout = tensor_layout(numels(shapes), device=unit.device)
        return scale_pieces(unit, layout, scale.reshape(-1)).reshape(shape)

    # ------------------------------------------------------------ shared-scale reduce
    def reduce(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shared-scale reduce of ``x`` as one tensor (see ``reduce_tensors``)."""
        return self.reduce_tensors(x, slot, comm, want_local, (x.shape,))

    def reduce_tensors(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool,
        shapes: Shapes,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Max all-reduce of the per-tensor scales, then the sum of the trits (class doc).

        Returns (mean over ranks, this rank's own decoded trits for error feedback).
        """
        flat = x.reshape(-1)
        sizes = numels(shapes)
        layout = tensor_layout(sizes, device=flat.device)
        scale = self._scales(flat, layout, sizes)
        if scale.numel():
            (scale,) = comm.all_reduce([scale], op="max")
        t = self._ternarize(flat, layout, scale, slot)
        local = None
        if want_local:
            local = scale_pieces(t.float(), layout, scale).reshape(x.shape)
        total = sum_trits(t, comm)
        mean = scale_pieces(total.float(), layout, scale / comm.world_size)
        return mean.reshape(x.shape), local


def sum_trits(t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The element-wise sum over ranks of int8 trits ``t``, by the cheaper collective.

    An int8 all-reduce (the sum stays in [-W, W], so W <= 127) sends 2(W-1)/W bytes
    per value; an all-gather of the packed trits (W-1) x 0.2: the link model decides.
    """
    world, n = comm.world_size, t.numel()
    if n == 0:
        return t
    by_gather = link_bytes("all_gather", packed_trits_len(n), world)
    if world <= 127 and link_bytes("all_reduce", n, world) <= by_gather:
        (total,) = comm.all_reduce([t], op="sum")
        return total
    packed = pack_trits(t.view(torch.uint8).add(1))  # -1, 0, 1 -> 0, 1, 2
    total = torch.full((n,), -world, dtype=torch.int16 if world < 2**14 else torch.int32,
                       device=t.device)
    for blob in comm.all_gather(packed):
        total.add_(unpack_trits(blob, n).to(t.device))
    return total
