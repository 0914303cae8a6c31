"""The fused Triton kernels equal the torch path, bit for bit, on the CPU.

Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py`` where there is no
GPU) runs each kernel on CPU tensors with NumPy; ``kernels.interpreted()`` sends CPU
tensors down the kernel path. Inputs are small (the interpreter runs each program in
Python) but cover what the kernels branch on: blocks cut short at a tensor's end,
empty tensors, blocks of one value and of the widest row, zeros, ties, subnormals.
Only speed needs a GPU (``gradzip bench gpu``, whose speed table also checks every
kernel's payload against the CPU's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import gradzip
from gradzip.codecs import Payload, kernels
from gradzip.codecs.layout import block_stats, tensor_layout
from gradzip.codecs.quantize import quantize_layout, safe_inverse

pytest.importorskip("triton")
if not kernels.interpreter_on():
    pytest.skip("TRITON_INTERPRET is not set (a GPU is present): the kernels are compiled",
                allow_module_level=True)

from gradzip.codecs.kernels import quant  # noqa: E402
from gradzip.codecs.kernels.blocks import block_table  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

#: buckets: (tensor sizes, block)
BUCKETS = [([1000, 0, 7, 300], 256), ([5000], 4096), ([33, 64, 1], 1), ([513], 512),
           ([0, 130, 129], 64)]
CPU = torch.device("cpu")


def _bucket(sizes: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), generator=g) * torch.logspace(-3, 3, sum(sizes))
    if x.numel() > 20:
        x[3:11] = 0.0  # an all-zero stretch (a zero block when the block is short)
        x[17] = -0.0
    return x


def _through(fused: bool, run: Callable[[], Any]) -> Any:
    """``run()`` on the kernel path (the interpreter) or on the torch path."""
    if not fused:
        return run()
    with kernels.interpreted():
        return run()


def _payload(spec: str, x: torch.Tensor, sizes: list[int], fused: bool) -> gradzip.Payload:
    shapes = [torch.Size((n,)) for n in sizes]
    return _through(fused, lambda: gradzip.codec(spec).encode(x, "b", shapes))


def _decoded(spec: str, p: gradzip.Payload, sizes: list[int], fused: bool) -> torch.Tensor:
    shapes = [torch.Size((n,)) for n in sizes]
    return _through(fused, lambda: gradzip.codec(spec).decode(p, "b", shapes))


def _paths_agree(spec: str, sizes: list[int], seed: int = 0) -> None:
    """The kernel path's payload equals the torch path's, field by field, and both
    decode to the same tensor."""
    x = _bucket(sizes, seed=seed)
    torch_p, kernel_p = _payload(spec, x, sizes, False), _payload(spec, x, sizes, True)
    assert dict(torch_p.leaves()).keys() == dict(kernel_p.leaves()).keys()
    for (name, a), (_, b) in zip(sorted(torch_p.leaves()), sorted(kernel_p.leaves()),
                                 strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{spec}: field {name} differs"
    assert torch.equal(_decoded(spec, torch_p, sizes, False),
                       _decoded(spec, kernel_p, sizes, True))


class _Draws:
    """A ``RandomBits`` stand-in that hands out one fixed stream of int16 draws in
    order, so the torch path's per-piece draws and the kernel's single draw agree."""

    def __init__(self, bits: torch.Tensor) -> None:
        self.bits, self.at = bits, 0

    def int16(self, k: int) -> torch.Tensor:
        self.at += k
        return self.bits[self.at - k:self.at]


def test_the_block_table_matches_the_torch_layout() -> None:
    for sizes, block in BUCKETS:
        table = block_table(sizes, block, CPU)
        layout = tensor_layout(sizes, block)
        assert table.count == layout.nblocks
        assert int(table.lengths.sum()) == sum(sizes)
        assert table.width >= block or table.width >= max(sizes)


@pytest.mark.parametrize(("sizes", "block"), BUCKETS)
@pytest.mark.parametrize("spec", ["int8(block={b})", "fp8(block={b})",
                                  "fp8(format=e5m2,block={b})"])
def test_deterministic_codecs_equal_the_torch_path(sizes: list[int], block: int,
                                                   spec: str) -> None:
    _paths_agree(spec.format(b=block), sizes)


@pytest.mark.parametrize(("sizes", "block"), BUCKETS)
@pytest.mark.parametrize(("levels", "l2", "clip"), [(127, False, False), (16, True, False),
                                                    (300, True, False), (1, False, True)])
def test_stochastic_rounding_equals_the_torch_path_given_the_same_draws(
        sizes: list[int], block: int, levels: int, l2: bool, clip: bool) -> None:
    """``qsgd`` and ``int8(stochastic=true)``: the same integers from the same draws;
    the kernel's L2 norms (float64 sums) within two float32 ulps of the torch path's."""
    x = _bucket(sizes, seed=1)
    bits = torch.randint(-2**15, 2**15, (x.numel(),), dtype=torch.int16,
                         generator=torch.Generator().manual_seed(2))
    dtype = torch.int8 if levels <= 127 else torch.int16
    with kernels.interpreted():
        q, stat = quant.quantize(x, block_table(sizes, block, CPU), levels, dtype, l2=l2,
                                 rand=bits, clip=clip)
    layout = tensor_layout(sizes, block)
    expected = (block_stats(x, layout, "sumsq").sqrt().float() if l2
                else block_stats(x, layout, "absmax").float())
    torch.testing.assert_close(stat, expected, rtol=2.5e-7, atol=0)
    ref = quantize_layout(x, layout, safe_inverse(levels, stat), levels, dtype,
                          _Draws(bits), clip=clip)  # type: ignore[arg-type]
    assert torch.equal(q, ref)


@pytest.mark.parametrize(("levels", "l2"), [(16, True), (127, False)])
def test_draws_on_the_device_round_as_the_torch_path_with_those_draws(levels: int,
                                                                      l2: bool) -> None:
    """The codecs' kernel path draws with Philox on the device from the slot's seed;
    ``random_draws`` gives those draws, and the torch path rounding with them makes the
    same integers. The draws are uniform 16-bit integers, different per seed."""
    sizes, block, seed = [3000, 17, 500], 256, 2**40 + 7
    x = _bucket(sizes, seed=4)
    with kernels.interpreted():
        table = block_table(sizes, block, CPU)
        q, stat = quant.quantize(x, table, levels, torch.int8, l2=l2, seed=seed)
        draws = quant.random_draws(seed, x.numel(), CPU)
        other = quant.random_draws(seed + 1, x.numel(), CPU)
    layout = tensor_layout(sizes, block)
    ref = quantize_layout(x, layout, safe_inverse(levels, stat), levels, torch.int8,
                          _Draws(draws))  # type: ignore[arg-type]
    assert torch.equal(q, ref)
    assert not torch.equal(draws, other)
    assert abs(draws.float().mean().item() + 0.5) < 3 * 2**16 / (12 * x.numel()) ** 0.5
    assert int(draws.min()) < -32000 and int(draws.max()) > 32000


@pytest.mark.parametrize("spec", ["qsgd(bucket=64)", "int8(stochastic=true,block=64)"])
def test_stochastic_codecs_decode_the_kernels_payload(spec: str) -> None:
    """A payload from the kernel decodes on the torch path as on the kernel's."""
    sizes = [700, 5, 0, 64]
    x = _bucket(sizes, seed=3)
    p = _payload(spec, x, sizes, True)
    assert torch.equal(_decoded(spec, p, sizes, False), _decoded(spec, p, sizes, True))


@pytest.mark.parametrize(("fmt", "dtype"), [("e4m3", torch.float8_e4m3fn),
                                            ("e5m2", torch.float8_e5m2)])
def test_fp8_rounds_every_tie_and_subnormal_as_torch(fmt: str, dtype: torch.dtype) -> None:
    """Scale 1 (the block's largest value is the format's): every representable value,
    every midpoint between neighbours (a tie, to even) and points just off them."""
    largest = quant.FP8[fmt][2]
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1])])
    values = values[values.abs() <= largest]
    x = torch.cat([torch.tensor([largest]), values])
    table = block_table([x.numel()], x.numel(), CPU)
    with kernels.interpreted():
        codes, scale = quant.fp8_encode(x, table, fmt)
    assert float(scale) == 1.0
    assert torch.equal(codes, x.to(dtype).view(torch.uint8))


@pytest.mark.parametrize(("fmt", "dtype"), [("e4m3", torch.float8_e4m3fn),
                                            ("e5m2", torch.float8_e5m2)])
def test_fp8_decodes_every_byte_as_torch(fmt: str, dtype: torch.dtype) -> None:
    """All 256 bytes, NaN and infinity included (a received payload is untrusted)."""
    codes = torch.arange(256, dtype=torch.uint8)
    with kernels.interpreted():
        out = quant.fp8_decode(codes, block_table([256], 256, CPU), torch.ones(1), fmt)
    expected = codes.view(dtype).float()
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(0.0), expected.nan_to_num(0.0))


@pytest.mark.parametrize("spec", ["int8(block=64)", "qsgd(bucket=64)", "fp8(block=64)"])
def test_the_kernel_path_refuses_a_payload_with_the_wrong_scales(spec: str) -> None:
    sizes = [300, 20]
    p = _payload(spec, _bucket(sizes), sizes, True)
    field = "norm" if spec.startswith("qsgd") else "scale"
    p.fields[field] = p.tensor(field)[:-1]
    with pytest.raises(gradzip.PayloadError, match="scales"):
        _decoded(spec, p, sizes, True)


def test_kernels_stay_off_without_a_gpu_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(8)
    assert not kernels.runs_on(x)
    with kernels.interpreted():
        assert kernels.runs_on(x, block=kernels.MAX_BLOCK)
        assert not kernels.runs_on(x, block=kernels.MAX_BLOCK + 1)
        monkeypatch.setenv("GRADZIP_KERNELS", "off")
        assert not kernels.runs_on(x)


@pytest.mark.parametrize("spec", ["int8", "fp8", "topk(ratio=0.1)", "signsgd(vote=false)",
                                  "centroid"])
def test_a_strided_tensor_takes_the_torch_path_and_codes_as_its_copy(spec: str) -> None:
    """A kernel reads memory in order whatever the strides say, so a strided view (a
    user's ``x[::2]``) takes the torch path: its payload is its contiguous copy's."""
    wide = _bucket([4000])
    strided = wide[::2]
    with kernels.interpreted():
        assert not kernels.runs_on(strided) and kernels.runs_on(strided.contiguous())
        got = gradzip.codec(spec).encode(strided, "s")
        want = gradzip.codec(spec).encode(strided.contiguous(), "s")
    for (name, a), (_, b) in zip(sorted(want.leaves()), sorted(got.leaves()), strict=True):
        assert torch.equal(a, b), f"{spec}: field {name} differs"


def test_an_unpack_counts_the_values_it_writes_not_the_bytes_it_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 packed signs unpack to 8,000 values: past ``MAX_NUMEL`` values written,
    the unpack takes the torch path however few bytes it reads."""
    from gradzip.codecs import bitpack

    signs = _bucket([8000]) < 0
    packed = bitpack.pack_bits(signs)
    from gradzip.codecs.kernels import bits

    def no_kernel(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the unpack kernel ran past MAX_NUMEL")

    monkeypatch.setattr(kernels, "MAX_NUMEL", 7999)
    monkeypatch.setattr(bits, "unpack", no_kernel)
    with kernels.interpreted():
        assert kernels.runs_on(packed) and not kernels.runs_on(packed, numel=8000)
        assert torch.equal(bitpack.unpack_bits(packed, 8000), signs)
        assert torch.equal(bitpack.bits_to_values(packed, 8000, 1.0, -1.0),
                           torch.where(signs, -1.0, 1.0))


@pytest.mark.parametrize("strided", [False, True])
def test_ans_lanes_codes_a_strided_tensor_through_its_planes(strided: bool) -> None:
    """The lanes format decides its path on its contiguous byte planes, so a strided
    tensor codes as its copy does (where no kernel runs for them, the reference codes
    on the host, on a GPU from a host copy, and the payload returns to the device)."""
    from gradzip.codecs.entropy import ans

    codes = (_bucket([5000]) * 4).round().clamp(-127, 127).to(torch.int8)
    t = codes[::2] if strided else codes
    with kernels.interpreted():
        p = ans.encode(t, backend="lanes")
        assert torch.equal(ans.decode(p), t)


def test_a_bucket_past_the_kernels_int32_indexing_takes_the_torch_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``MAX_NUMEL`` (2^31 less a block; 100 here, so the test allocates little)
    the int32 offsets of a kernel would wrap: such a tensor takes the torch path."""
    assert kernels.MAX_NUMEL <= 2**31 - 16384  # the widest block a kernel indexes
    monkeypatch.setattr(kernels, "MAX_NUMEL", 100)
    with kernels.interpreted():
        assert kernels.runs_on(torch.zeros(100)) and not kernels.runs_on(torch.zeros(101))


def _ties_at_the_threshold(n: int, k: int, seed: int) -> torch.Tensor:
    """Small values, a block of equal magnitudes (+-0.5, and -0.0 beside 0.0) where the
    k-th largest falls, and a few larger ones: the selection must split the ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.01
    ties = torch.randperm(n, generator=g)[:3 * k]
    x[ties] = torch.where(torch.rand(3 * k, generator=g) < 0.5, 0.5, -0.5)
    x[ties[: k // 3]] = 3.0
    x[:5] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0])
    return x


@pytest.mark.parametrize(("n", "k", "ties"), [(10_000, 100, False), (9_000, 1, False),
                                              (5_000, 4_999, False), (12_345, 777, True),
                                              (4_096, 300, True), (70_000, 64, True)])
def test_the_radix_select_keeps_the_cpu_paths_positions(n: int, k: int, ties: bool) -> None:
    """The exact top-k by magnitude in position order, ties to the lowest positions."""
    from gradzip.codecs.sparse import topk_positions

    x = _ties_at_the_threshold(n, k, n) if ties else torch.randn(
        n, generator=torch.Generator().manual_seed(k))
    with kernels.interpreted():
        from gradzip.codecs.kernels import select

        got = select.topk_positions(x, k)
    expected = topk_positions(x, k, torch.Generator().manual_seed(0))
    assert torch.equal(got, expected.to(torch.int64))


def test_a_constant_tensor_keeps_its_first_k_positions() -> None:
    with kernels.interpreted():
        from gradzip.codecs.kernels import select

        got = select.topk_positions(torch.full((9_000,), -2.0), 50)
    assert torch.equal(got, torch.arange(50))


@pytest.mark.parametrize("spec", ["topk(ratio=0.01)", "ef | topk(ratio=0.01)",
                                  "topk(k=40) | qsgd"])
def test_topk_payloads_equal_the_torch_path(spec: str) -> None:
    sizes = [6_000, 0, 300, 2_000]
    x = _ties_at_the_threshold(sum(sizes), 83, 5)
    torch_p, kernel_p = _payload(spec, x, sizes, False), _payload(spec, x, sizes, True)
    deterministic = "qsgd" not in spec  # qsgd's draws differ by path, its positions not
    for (name, a), (_, b) in zip(sorted(torch_p.leaves()), sorted(kernel_p.leaves()),
                                 strict=True):
        if deterministic or not name.endswith(("q", "norm")):
            assert torch.equal(a, b), f"{spec}: field {name} differs"


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 5_000, 20_001])
def test_bit_packing_equals_the_cpu_path(n: int) -> None:
    """Signs (-0.0 negative), bools, and back to bools or two floats, as numpy packs."""
    from gradzip.codecs import bitpack

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if n > 3:
        x[:3] = torch.tensor([0.0, -0.0, -1e-45])
    mask = torch.rand(n, generator=g) < 0.3
    signs, bools = bitpack.pack_signs(x), bitpack.pack_bits(mask)
    with kernels.interpreted():
        assert torch.equal(bitpack.pack_signs(x), signs)
        assert torch.equal(bitpack.pack_bits(mask), bools)
        assert torch.equal(bitpack.unpack_bits(bools, n), mask)
        got = bitpack.bits_to_values(signs, n, 0.25, -3.5)
    assert torch.equal(got, bitpack.bits_to_values(signs, n, 0.25, -3.5))


@pytest.mark.parametrize("spec", ["signsgd(vote=false)", "efsignsgd", "onebit",
                                  "ef | signsgd(vote=false,scale=l1)"])
def test_sign_codecs_equal_the_torch_path(spec: str) -> None:
    _paths_agree(spec, [64 * 40, 17, 0, 300], seed=6)


@pytest.mark.parametrize("n", [0, 1, 4, 5, 6, 4_999, 12_003])
def test_trit_packing_equals_the_cpu_path(n: int) -> None:
    from gradzip.codecs import bitpack

    codes = torch.randint(0, 3, (n,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(n))
    packed = bitpack.pack_trits(codes)
    values = (-0.75, 0.0, 1.25)
    with kernels.interpreted():
        assert torch.equal(bitpack.pack_trits(codes), packed)
        assert torch.equal(bitpack.unpack_trits(packed, n), codes)
        got = bitpack.trits_to_values(packed, n, values)
    assert torch.equal(got, bitpack.trits_to_values(packed, n, values))


def test_a_trit_byte_past_242_is_refused_or_flagged() -> None:
    """Untrusted bytes: at once outside deferred checks; inside them, a flag on the
    device and a decode that reads only valid codes."""
    from gradzip.codecs import bitpack
    from gradzip.codecs.validation import deferred_checks

    packed = bitpack.pack_trits(torch.ones(10, dtype=torch.uint8))
    packed[1] = 250
    with kernels.interpreted():
        with pytest.raises(ValueError, match="a code of 250 exceeds 242"):
            bitpack.trits_to_values(packed, 10, (-1.0, 0.0, 1.0))
        with deferred_checks() as checks:
            out = bitpack.unpack_trits(packed, 10)
    assert bool(checks.failed(torch.device("cpu")))
    assert int(out.max()) <= 2


@pytest.mark.parametrize("spec", ["terngrad", "ef | terngrad", "terngrad(shared=false)"])
def test_terngrad_equals_the_torch_path(spec: str) -> None:
    _paths_agree(spec, [3_000, 0, 41, 500], seed=8)


# ---------------------------------------------------------------- ans on the device
def _rans_case(dtype: torch.dtype, n: int, spread: float = 30.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype == torch.uint8:  # one symbol: the whole scale, no words
        return torch.full((n,), 9, dtype=dtype)
    return (torch.randn(n, generator=g) * spread).round().clamp(-3000, 3000).to(dtype)


@pytest.mark.parametrize(("dtype", "n"), [(torch.int8, 16_384 + 100), (torch.int16, 300),
                                          (torch.uint8, 50)])
def test_rans_kernels_write_the_references_words(dtype: torch.dtype, n: int) -> None:
    """Histogram, encode and decode kernels against ``entropy/lanes.py``: two blocks
    (the second short), two byte planes, a one-symbol plane."""
    from gradzip.codecs.entropy import lanes
    from gradzip.codecs.kernels import rans

    planes = lanes.planes_of(_rans_case(dtype, n))
    counts = rans.histogram(planes)
    assert torch.equal(counts, lanes.histogram(planes))
    freq = lanes.quantize(counts)
    coded = rans.encode(planes, freq)
    want = lanes.encode(planes, freq)
    for name in ("freq", "words", "states", "sums", "data"):
        assert torch.equal(getattr(coded, name), getattr(want, name)), name
    out, sound = rans.decode(want, n)
    assert bool(sound) and torch.equal(out, planes)


def test_the_rans_decode_kernel_flags_corrupt_blocks_and_stays_in_bounds() -> None:
    from gradzip.codecs.entropy import lanes
    from gradzip.codecs.kernels import rans

    planes = lanes.planes_of(_rans_case(torch.int8, 2_000))
    good = lanes.encode(planes, lanes.quantize(lanes.histogram(planes)))
    flipped = good.data.clone()
    flipped[5] ^= 1
    for bad in (lanes.Coded(good.freq, good.words, good.states, good.sums, flipped),
                lanes.Coded(good.freq, torch.full_like(good.words, 2**31 - 1), good.states,
                            good.sums, good.data)):
        out, sound = rans.decode(bad, 2_000)
        assert not bool(sound) and out.shape == planes.shape


def test_ans_picks_the_kernel_by_device_and_both_sides_decode_it() -> None:
    """``ans`` (default backend) on a device tensor writes the lanes format with the
    kernel: the same payload as ``backend=lanes`` on the CPU, decoded by either."""
    from gradzip.codecs.entropy import ans

    t = _rans_case(torch.int8, 5_000, spread=4.0)  # compresses: coded, not raw
    with kernels.interpreted():
        fused = ans.encode(t)
        assert torch.equal(ans.decode(fused), t)
    cpu = ans.encode(t, backend="lanes")
    assert fused.meta["m"] == "lanes"
    assert Payload({"f": fused}).serialize() == Payload({"f": cpu}).serialize()
    assert torch.equal(ans.decode(fused), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lossless_codes_its_exponent_plane_with_the_kernel(dtype: torch.dtype) -> None:
    """``lossless`` on a device tensor: planes split by torch, the exponent plane by the
    lanes kernel, the rest raw; exact where it is decoded, and on a host."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(12_000, generator=g) * torch.randn(12_000, generator=g).exp()).to(dtype)
    codec = gradzip.codec("lossless")
    with kernels.interpreted():
        p = codec.encode(x, "k")
        assert torch.equal(codec.decode(p, "k").view(torch.uint8), x.view(torch.uint8))
    assert [p.child(f"p{i}").meta["m"] for i in range(len(p.fields))][:2] == ["lanes", "rawt"]
    assert p.wire_bytes < x.numel() * x.element_size()
    y = gradzip.codec("lossless").decode(Payload.deserialize(p.serialize()), "k")
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_ans_on_the_device_reads_the_host_once_to_encode_and_never_to_decode() -> None:
    """The host-read budget of the lanes path (issue 44 item 1), counted as a GPU would
    make them: encode reads the word count that sizes the payload; a decode under
    deferred checks reads nothing (its flag is read with the reduction's others)."""
    from gradzip.bench.devicecheck import count_host_syncs
    from gradzip.codecs.entropy import ans
    from gradzip.codecs.validation import deferred_checks

    t = _rans_case(torch.int8, 5_000, spread=4.0)
    with kernels.interpreted():
        with count_host_syncs() as encoding:
            p = ans.encode(t)
        with deferred_checks() as checks, count_host_syncs() as decoding:
            y = ans.decode(p)
    assert encoding.total == 1 and decoding.total == 0, (encoding.counts, decoding.counts)
    assert torch.equal(y, t) and not bool(checks.failed(torch.device("cpu")))


@pytest.mark.parametrize(("n", "seed"), [(10_000, 5), (4_097, 2**40 + 17), (3, 2**63 - 1)])
def test_randomk_hash_keys_equal_the_cpu_paths(n: int, seed: int) -> None:
    from gradzip.codecs.kernels import hashk
    from gradzip.codecs.sparse import hash_keys

    with kernels.interpreted():
        got = hashk.keys(n, seed, CPU)
    assert torch.equal(got.to(torch.int64), hash_keys(n, seed))


def test_randomk_chooses_its_positions_on_the_device_and_any_side_decodes() -> None:
    """On the kernel path ``randomk`` keeps the k largest hashed keys (the radix select,
    no host work); the payload says so, and the CPU rebuilds the same positions."""
    from gradzip.codecs.sparse import hash_positions

    x = torch.randn(20_000, generator=torch.Generator().manual_seed(6))
    codec = gradzip.codec("randomk(ratio=0.01)")
    with kernels.interpreted():
        p = codec.encode(x, "k")
        fused = codec.decode(p, "k")
        on_device = hash_positions(20_000, 200, p.int("seed"), x)
    assert p.meta["gen"] == "hash"
    assert torch.equal(on_device, hash_positions(20_000, 200, p.int("seed"), x))
    cpu = gradzip.codec("randomk(ratio=0.01)").decode(Payload.deserialize(p.serialize()), "k")
    assert torch.equal(cpu, fused) and torch.equal(cpu[on_device], x[on_device])


def test_lossless_keeps_the_host_coders_it_was_asked_for_on_a_device() -> None:
    """``exponent=huff`` or ``rest=zstd`` name host coders: the device path is not
    taken for them (it codes the exponent with ans and sends the rest raw)."""
    x = torch.randn(4_000, generator=torch.Generator().manual_seed(4))
    for spec in ("lossless(exponent=huff)", "lossless(rest=zstd)"):
        with kernels.interpreted():
            p = gradzip.codec(spec).encode(x, "k")
        assert all(p.child(name).meta["m"] not in ("lanes", "rawt") for name in p.fields)


#: centroid's options the kernel branches on: 1 to 64 levels, no Lloyd step or several,
#: buckets of one value, of a power of two and not, and one cut short at the end
CENTROID_SPECS = ["centroid", "centroid(bits=4, lloyd=0)", "centroid(bits=3, bucket=100, lloyd=2)",
                  "centroid(bits=1)", "centroid(bits=7, bucket=64, lloyd=1)",
                  "centroid(bucket=1)"]


@pytest.mark.parametrize("spec", CENTROID_SPECS)
@pytest.mark.parametrize("sizes", [[1000, 0, 7, 300], [33, 64, 1]])
def test_centroid_equals_the_torch_path(spec: str, sizes: list[int]) -> None:
    _paths_agree(spec, sizes)


@pytest.mark.parametrize("seed", range(4))
def test_centroid_equals_the_torch_path_on_heavy_tails_and_ties(seed: int) -> None:
    """Magnitudes 2**40 apart in one bucket (float64 sums in another order), runs of
    equal magnitudes split by a bin edge (ranks tie to the lower position), zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1500, generator=g) * torch.exp(4 * torch.randn(1500, generator=g))
    x[100:400] = torch.where(torch.rand(300, generator=g) < 0.5, 0.25, -0.25)
    x[600:700] = 0.0
    for spec in ("centroid", "centroid(bits=4)", "centroid(bits=3, lloyd=0)"):
        shapes = [torch.Size((x.numel(),))]
        codec = gradzip.codec(spec)
        expected = codec.encode(x, "b", shapes)
        with kernels.interpreted():
            fused = codec.encode(x, "b", shapes)
        for (name, a), (_, b) in zip(sorted(expected.leaves()), sorted(fused.leaves()),
                                     strict=True):
            assert torch.equal(a, b), f"{spec}: field {name} differs"


@pytest.mark.parametrize("bad", [3, -3, -128])
def test_the_centroid_decode_kernel_refuses_or_flags_a_code_past_its_bins(bad: int) -> None:
    """2 bits: codes -2..2. Read at once, a code past them is refused; under deferred
    checks it is flagged and decoded clamped, reading nothing out of bounds."""
    from gradzip.codecs.validation import deferred_checks

    sizes = [600]
    p = _payload("centroid", _bucket(sizes), sizes, True)
    p.fields["q"] = p.tensor("q").clone()
    p.tensor("q")[517] = bad
    for fused in (False, True):
        with pytest.raises(gradzip.PayloadError, match="centroid payload"):
            _decoded("centroid", p, sizes, fused)
    with kernels.interpreted(), deferred_checks() as checks:
        out = gradzip.codec("centroid").decode(p, "b", [torch.Size((600,))])
    assert bool(checks.failed(CPU)) and out.isfinite().all()


def test_centroid_on_the_device_reads_the_host_only_to_check_a_received_payload() -> None:
    """The stage's encode reads nothing; its decode reads its flags once, or not at all
    under deferred checks (issue 44 item 1, counted as a GPU would count them; a
    chain's own check for non-finite input is the hooks' one read per reduction)."""
    from gradzip.bench.devicecheck import count_host_syncs
    from gradzip.codecs.centroid import Centroid
    from gradzip.codecs.validation import deferred_checks

    stage, x = Centroid(bits=4), _bucket([3040])
    with kernels.interpreted():
        with count_host_syncs() as encoding:
            p = stage.encode(x, None)
        with count_host_syncs() as checked:
            stage.decode(p, x.shape, None)
        with deferred_checks(), count_host_syncs() as deferred:
            stage.decode(p, x.shape, None)
    assert (encoding.total, checked.total, deferred.total) == (0, 1, 0)
