"""The contract every registered stage keeps, checked for all of them.

A new codec gets these tests for free by registering itself: shapes and dtypes
round-trip through the serialized form, wire bytes are honest, state pickles,
non-finite input fails clearly, summable codecs really sum, and every codec
aggregates over a simulated group.
"""

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs import (
    Compressor,
    LosslessCoder,
    Payload,
    PayloadError,
    registered,
)
from gradzip.collectives import run_simulated

COMPRESSORS = sorted(n for n, c in registered().items() if issubclass(c, Compressor))
#: every lossless stage, and every backend of one that has another format
CODERS = [*sorted(n for n, c in registered().items() if issubclass(c, LosslessCoder)),
          "ans(backend=lanes)"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (64, 33), (1, 1, 1, 9)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def heavy_tailed(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.randn(shape, generator=g).exp()
    return x.to(dtype)


def roundtrip(c, x, key="k"):
    p = c.encode(x, key=key)
    data = p.serialize()
    assert len(data) == p.wire_bytes, "wire_bytes must equal the serialized length"
    return c.decode(Payload.deserialize(data)), p


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_dtypes_roundtrip(name, dtype):
    c = gradzip.codec(name)
    for step in range(2):  # a second step exercises warm-started state
        for i, shape in enumerate(SHAPES):
            x = heavy_tailed(shape, seed=i + 10 * step, dtype=dtype)
            y, _ = roundtrip(c, x, key=f"t{i}")
            assert y.shape == x.shape and y.dtype == x.dtype, (name, shape)
            assert torch.isfinite(y.float()).all(), (name, shape)
            Payload({"y": y}).serialize()  # an ordinary tensor (empty ones too)


@pytest.mark.parametrize("name", COMPRESSORS)
@given(data=st.data())
def test_property_roundtrip_is_honest(name, data):
    shape = data.draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
    scale = data.draw(st.sampled_from([1e-6, 1.0, 1e4]))
    dtype = data.draw(st.sampled_from(DTYPES))
    seed = data.draw(st.integers(0, 2**16))
    c = gradzip.codec(name)
    limit = torch.finfo(dtype).max  # finite in every dtype (fp16 ends at 65504)
    x = (heavy_tailed(shape, seed) * scale).clamp(-limit, limit).to(dtype)
    y, p = roundtrip(c, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all(), "a finite input decodes to finite values"
    # a codec never sends more than raw fp32 plus a small, bounded header
    assert p.wire_bytes <= 2 * (4 * x.numel()) + 256, (name, p.wire_bytes, x.numel())


@pytest.mark.parametrize("name", COMPRESSORS)
def test_state_pickles_and_restores(name):
    c = gradzip.codec(name)
    for i in range(3):
        c.encode(heavy_tailed((16, 8), i), key="w")
    sd = pickle.loads(pickle.dumps(c.state_dict()))
    d = gradzip.codec(name)
    d.load_state_dict(sd)
    x = heavy_tailed((16, 8), 99)
    assert torch.equal(c.decode(c.encode(x, "w")), d.decode(d.encode(x, "w")))


@pytest.mark.parametrize("name", COMPRESSORS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_is_an_error(name, bad):
    x = heavy_tailed((10,))
    x[3] = bad
    with pytest.raises(gradzip.NonFiniteGradientError, match="non-finite"):
        gradzip.codec(name).encode(x, key="bad")
    nan = gradzip.codec(name, nonfinite="propagate")
    assert torch.isnan(nan.decode(nan.encode(x))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_finiteness_check_is_exact_when_the_sum_overflows(dtype, bad):
    """Huge finite values whose sum overflows are still finite; one bad value is not."""
    big = torch.finfo(dtype).max / 2
    x = torch.full((1000,), big, dtype=dtype)
    x[1::2] = big * 0.99  # same sign everywhere: the sum overflows to +inf
    if bad is not None:
        x[7] = bad
    codec = gradzip.codec("none")
    if bad is None:
        assert codec._check_input(x, "huge")
    else:
        with pytest.raises(gradzip.NonFiniteGradientError):
            codec._check_input(x, "huge")


@pytest.mark.parametrize("name", COMPRESSORS)
def test_reduce_over_simulated_group(name):
    """Every codec aggregates over 3 virtual workers; all agree on the result."""

    def work(rank, comm):
        c = gradzip.codec(name, rank=rank)
        outs = []
        for step in range(3):
            x = heavy_tailed((24, 10), seed=100 * step + rank)
            mean, local = reduce(c, x, "w", comm, want_local=True)
            assert mean.shape == x.shape and local is not None and local.shape == x.shape
            outs.append(mean)
        return outs, comm.counter.total_handed

    results = run_simulated(3, work)
    for step in range(3):
        for rank in range(1, 3):
            assert torch.allclose(results[rank][0][step], results[0][0][step]), name
    assert all(nbytes > 0 for _, nbytes in results)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,)])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_reduce_of_scalars_and_empty_tensors(name, shape):
    """0-d and empty tensors aggregate too, in low precision, over the simulated group."""
    dtype = DTYPES[len(shape) % len(DTYPES)]

    def work(rank, comm):
        c = gradzip.codec(name, rank=rank)
        outs = []
        for step in range(2):
            x = heavy_tailed(shape, seed=10 * step + rank, dtype=dtype)
            mean, local = reduce(c, x, "w", comm, want_local=True)
            assert mean.shape == x.shape and mean.dtype == x.dtype
            assert local is not None and local.shape == x.shape
            assert torch.isfinite(mean.float()).all()
            outs.append(mean)
        return outs

    results = run_simulated(2, work)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b), name


SUMMABLE = [n for n in COMPRESSORS if registered()[n].summable] + [
    "randomk(ratio=0.2) | fp16", "randomk(ratio=0.2) | bf16", "randomk(ratio=0.3, scale=true)",
]


@pytest.mark.parametrize("name", SUMMABLE)
@settings(max_examples=6)
@given(shape=st.sampled_from([(50, 4), (), (0,), (1,), (7, 3, 2), (1000,)]),
       seed=st.integers(0, 2**16))
def test_summable_codecs_sum(name, shape, seed):
    """decode(sum of payloads) == sum of decodes, through the simulated all-reduce."""
    xs = [heavy_tailed(shape, seed=seed + r) for r in range(3)]

    def work(rank, comm):
        c = gradzip.codec(name, rank=rank)
        own = c.decode(c.encode(xs[rank] / 3, key="w"))
        c2 = gradzip.codec(name, rank=rank)
        assert c2.summable, name
        mean, _ = reduce(c2, xs[rank], "w", comm)
        assert set(comm.counter.handed) == {"all_reduce"}, "summable payloads are all-reduced"
        return own, mean

    out = run_simulated(3, work)
    expected = sum(o for o, _ in out)
    for _, mean in out:
        atol = 1e-3 * float(expected.abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(mean, expected, rtol=1e-2, atol=atol)


def _coded_fields(p):
    """How many fields of ``p`` (at any depth) a lossless stage re-coded."""
    return sum(
        ("@" in v.meta) + _coded_fields(v) for v in p.fields.values() if isinstance(v, Payload)
    )


@pytest.mark.parametrize("lossy", ["int8(block=64)", "topk(ratio=0.1) | qsgd",
                                   "terngrad(shared=false)", "natural", "none"])
@pytest.mark.parametrize("name", CODERS)
def test_lossless_stage_is_exact_after_a_quantizer(name, lossy):
    base = gradzip.codec(lossy)
    chained = gradzip.codec(f"{lossy} | {name}")
    x = heavy_tailed((3000,))
    y, p = roundtrip(chained, x, key="k")
    assert torch.equal(y, base.decode(base.encode(x, key="k")))  # the same random draws
    if lossy != "none" or chained.coders[0][1].accepts(x):
        assert _coded_fields(p) > 0, f"{name} coded nothing after {lossy}"


@pytest.mark.parametrize("name", CODERS)
@pytest.mark.parametrize("kind", ["peaked", "wide", "constant"])
def test_lossless_stage_catches_every_flipped_bit(name, kind):
    """A coded field with one bit flipped anywhere raises PayloadError, or (if the flip
    hit something that does not change the result) decodes to the exact input."""
    g = torch.Generator().manual_seed(0)
    t = {
        "peaked": (torch.randn(400, generator=g) * 4).round().to(torch.int8),
        "wide": torch.randint(-(2**20), 2**20, (300,), generator=g, dtype=torch.int32),
        "constant": torch.full((200,), 7, dtype=torch.int16),
    }[kind]
    coder = gradzip.codec(name).coders[0][1]
    wire = Payload({"f": coder.encode_field(t)}).serialize()
    for i in range(len(wire)):
        bad = bytearray(wire)
        bad[i] ^= 1 << (i % 8)
        try:
            y = coder.decode_field(Payload.deserialize(bytes(bad)).child("f"))
        except PayloadError:
            continue
        assert y.dtype == t.dtype and torch.equal(y, t), f"flip at byte {i} decoded silently"


def _leaf_paths(p, prefix=()):
    for name, value in p.fields.items():
        if isinstance(value, torch.Tensor):
            yield (*prefix, name)
        elif isinstance(value, Payload):
            yield from _leaf_paths(value, (*prefix, name))


def _truncated(p, path):
    """``p`` with the tensor at ``path`` one element short."""
    value = p.fields[path[0]]
    cut = value.reshape(-1)[:-1] if len(path) == 1 else _truncated(value, path[1:])
    return Payload({**p.fields, path[0]: cut}, dict(p.meta))


@pytest.mark.parametrize("name", COMPRESSORS + ["topk | qsgd | ans", "randomk | fp16",
                                  "sharedtopk(values=int8)"])
def test_mismatched_payloads_raise_payload_errors(name):
    """A payload that does not fit (another shape, a field cut short) raises PayloadError
    or still decodes to a finite tensor of the asked shape; never another exception."""
    c = gradzip.codec(name)
    x = heavy_tailed((300, 40))
    c.encode(x, key="w")  # a second step: gradiveq sends codes, not the raw tensor
    p = c.encode(x, key="w")
    cases = [Payload(p.fields, {**p.meta, "shape": shape}) for shape in [(301, 40), (3,), ()]]
    cases += [_truncated(p, path) for path in _leaf_paths(p) if p.fields]
    for bad in cases:
        try:
            y = c.decode(Payload.deserialize(bad.serialize()))
        except PayloadError:
            continue
        assert y.shape == bad.shape() and torch.isfinite(y).all(), name


@pytest.mark.parametrize("bad, message", [
    (torch.arange(6), "floating-point"),
    (torch.ones(3, dtype=torch.bool), "floating-point"),
    ([1.0, 2.0], "torch.Tensor"),
    (torch.ones(3, dtype=torch.complex64), "floating-point"),
])
def test_non_float_input_is_a_clear_type_error(bad, message):
    with pytest.raises(TypeError, match=message):
        gradzip.codec("topk").encode(bad, key="w")


@pytest.mark.parametrize("name", sorted(registered()))
def test_fresh_builds_the_same_chain_from_the_stages_without_parsing(name: str) -> None:
    """``Codec.fresh`` is how a parsed method gives every rank and group its codec: the
    same stages with the same parameters, new stage objects, empty state."""
    c = gradzip.codec(name, seed=5, aggregate="gather")
    c.state.slot(0, "w").data["x"] = torch.ones(1)
    f = c.fresh(rank=3)
    assert str(f) == str(c) and f.to_json() == c.to_json()
    assert (f.state.seed, f.state.rank, f.aggregate) == (5, 3, "gather")
    assert not f.state.records and all(a is not b for a, b in zip(f.stages, c.stages,
                                                                  strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
def test_the_finiteness_check_is_exact(dtype: torch.dtype) -> None:
    """One aminmax pass decides: values whose sum overflows are still finite; a single
    NaN, +Inf or -Inf anywhere is not."""
    from gradzip.codecs.chain import Codec, nonfinite_flag

    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)  # the sum overflows
    assert Codec.is_finite(big) and not bool(nonfinite_flag(big))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 517, 999):
            x = big.clone() if at % 2 else torch.randn(1000).to(dtype)
            x[at] = bad
            assert not Codec.is_finite(x) and bool(nonfinite_flag(x)), (bad, at)
    assert Codec.is_finite(torch.empty(0, dtype=dtype))


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("spec", ["fp16", "bf16", "none", "int8"])
def test_the_flag_from_encoding_is_exact_and_the_cast_still_saturates(
        spec: str, device_path: bool) -> None:
    """``encode_checked`` flags exactly the inputs with NaN/Inf, whether the stage reads
    the flag off its own output (the casts, on the CPU) or checks first (a GPU's path):
    a finite value past fp16's range is no NaN/Inf (it saturates), one bad value is."""
    import contextlib

    from gradzip.codecs.chain import Codec
    from gradzip.codecs.nonfinite import device_path_only

    with device_path_only() if device_path else contextlib.nullcontext():
        _check_flags(Codec.from_spec(spec), spec)


def _check_flags(codec: gradzip.codecs.Codec, spec: str) -> None:
    big = torch.randn(4096)
    big[7] = 1e6  # finite, but Inf once cast to fp16
    payload, flag = codec.encode_checked(big, "w", None)
    assert not bool(flag)
    if spec == "fp16":
        values = payload.tensor("values")
        assert torch.isfinite(values).all() and float(values[7]) == 65504.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 2049, 4095):
            x = big.clone()
            x[at] = bad
            assert bool(codec.encode_checked(x, "w", None)[1]), (bad, at)
    _, flag = codec.encode_checked(torch.empty(0), "w", None)
    assert not bool(flag)


def _layout(p: Payload) -> tuple:
    """A payload's shape without its values: every tensor's path, dtype and shape, and
    the metadata of every node."""
    nodes = [sorted(p.meta.items())] + [_layout(v) for v in p.fields.values()
                                        if isinstance(v, Payload)]
    return tuple((n, t.dtype, tuple(t.shape)) for n, t in p.leaves()), repr(nodes)


#: the fixed-layout stages, in their single-round form where the default is multi-round
FIXED = [{"signsgd": "signsgd(vote=false)", "terngrad": "terngrad(shared=false)"}.get(n, n)
         for n in COMPRESSORS if registered()[n].fixed_layout]


@pytest.mark.parametrize("spec", FIXED + ["topk(ratio=0.2)", "topk(ratio=0.01)",
                                          "topk(k=5, chunk=64)", "topk(ratio=0.1) | int8",
                                          "int8(block=7)", "ef | topk(ratio=0.05)"])
@pytest.mark.parametrize("shapes", [None, [(40, 9), (7,), (23,)]])
def test_a_fixed_layout_does_not_depend_on_the_values(spec, shapes):
    """A fixed-layout codec's payload crosses as a buffer of a length every rank knows
    (``aggregation.fixed``): values as different as zeros, a constant, a spike, a
    heavy tail or denormals must give one layout, or ranks would read each other's
    bytes at the wrong offsets."""
    codec = gradzip.codec(spec)
    assert codec.fixed_layout, spec
    n = 40 * 9 + 7 + 23
    spike = torch.zeros(n)
    spike[17] = 1e6
    inputs = [torch.zeros(n), torch.full((n,), 3.0), spike, heavy_tailed((n,), seed=3),
              heavy_tailed((n,), seed=4) * 1e-40, torch.arange(n, dtype=torch.float32)]
    sizes = [torch.Size(s) for s in shapes] if shapes else None
    layouts = {_layout(codec.encode_body(x, "k", sizes)) for x in inputs}
    assert len(layouts) == 1, (spec, layouts)


@pytest.mark.parametrize("spec", ["threshold", "topk | ans", "int8 | zstd", "randomk",
                                  "powersgd", "int8(shared=narrow)"])
def test_payloads_whose_layout_can_vary_are_not_fixed(spec):
    assert not gradzip.codec(spec).fixed_layout
