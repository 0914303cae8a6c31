"""Aggregation paths (all-reduce, gather, two-phase, reduce-scatter) on simulated ranks."""

import pytest
import torch

import gradzip
from gradzip.aggregation import path_for, reduce, reduce_scatter
from gradzip.aggregation.layout import chunk_bounds, piece_shapes
from gradzip.codecs.chain import CodecObserver
from gradzip.collectives import run_simulated
from gradzip.collectives.linkmodel import link_bytes


def _inputs(rank: int, n: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g)


def test_chunk_bounds_and_pieces():
    assert chunk_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert chunk_bounds(2, 4) == [0, 1, 2, 2, 2]
    shapes = [torch.Size((2, 3)), torch.Size(()), torch.Size((0,)), torch.Size((4,))]
    # [0,6) is the matrix, 6 the scalar, the empty tensor sits at 7, then [7, 11)
    assert piece_shapes(shapes, 0, 6) == [torch.Size((2, 3))]
    assert piece_shapes(shapes, 4, 9) == [torch.Size((2,)), torch.Size(()), torch.Size((0,)),
                                          torch.Size((2,))]
    assert piece_shapes(None, 0, 3) is None
    for start, end in [(0, 11), (3, 8), (5, 11)]:
        assert sum(s.numel() for s in piece_shapes(shapes, start, end)) == end - start


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("path", ["gather", "two_phase"])
def test_lossless_payloads_give_the_exact_mean(world, path):
    """A non-summable but exact codec (``none | zstd``) averages exactly on both paths,
    for sizes that do not divide by the world size and with tensor shapes given."""
    n = 1001
    shapes = [torch.Size((10, 50)), torch.Size((1,)), torch.Size((500,))]

    def work(rank, comm):
        c = gradzip.codec(f"none | zstd | aggregate={path}", rank=rank)
        mean, local = reduce(c, _inputs(rank, n), "w", comm, want_local=True, shapes=shapes)
        return mean, local

    results = run_simulated(world, work)
    exact = sum(_inputs(r, n) for r in range(world)) / world
    for rank, (mean, local) in enumerate(results):
        torch.testing.assert_close(mean, exact, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(local, _inputs(rank, n))


@pytest.mark.parametrize("spec", ["ef | topk(ratio=0.1)", "ef | qsgd(levels=4)"])
def test_two_phase_feedback_conserves_the_gradient(spec):
    """Error feedback on both phases: what was applied in total is what came in minus
    the senders' residuals (mean over ranks) minus the owners' chunk residuals."""
    world, n, steps = 4, 403, 12

    def work(rank, comm):
        c = gradzip.codec(f"{spec} | aggregate=two_phase", rank=rank)
        total_out = torch.zeros(n)
        for step in range(steps):
            mean, _ = reduce(c, _inputs(rank, n, step), "w", comm)
            total_out += mean
        sender = c.state.slot(0, "w").data["residual"]
        owner = c.state.slot(0, "w/owner").data["residual"]
        return total_out, sender, owner

    results = run_simulated(world, work)
    total_in = sum(_inputs(r, n, s) for r in range(world) for s in range(steps)) / world
    held = sum(r[1] for r in results) / world + torch.cat([r[2] for r in results])
    for total_out, _, _ in results:
        torch.testing.assert_close(total_out, total_in - held, rtol=1e-4, atol=1e-4)


def _bytes_per_rank(spec: str, world: int, n: int) -> int:
    def work(rank, comm):
        c = gradzip.codec(spec, rank=rank)
        reduce(c, _inputs(rank, n), "w", comm)
        return comm.counter.total_wire

    return max(run_simulated(world, work))


def test_two_phase_traffic_does_not_grow_with_world_size():
    n = 1 << 15
    payload = gradzip.codec("qsgd").encode(torch.randn(n)).wire_bytes
    gather = {w: _bytes_per_rank("qsgd | aggregate=gather", w, n) for w in (2, 8)}
    two = {w: _bytes_per_rank("qsgd | aggregate=two_phase", w, n) for w in (2, 8)}
    assert gather[8] > 6.5 * payload  # (W-1) x payload
    assert two[8] < 2 * payload  # 2 (W-1)/W x payload, plus headers and size exchanges
    assert two[8] < gather[8] / 3
    assert abs(two[2] - gather[2]) < 0.05 * gather[2]


def test_auto_follows_the_link_model():
    x = torch.randn(1 << 14)
    qsgd = gradzip.codec("qsgd")
    assert path_for(qsgd, x, 2) == "gather"
    assert path_for(qsgd, x, 8) == "two_phase"
    # a fixed number of kept values: chunks cost as much as the whole, gather wins
    fixed = gradzip.codec("topk(k=16)")
    assert path_for(fixed, x, 8) == "gather"
    assert path_for(gradzip.codec("fp16"), x, 8) == "all_reduce"
    assert path_for(gradzip.codec("ef | powersgd"), x, 8) == "multi_round"
    assert path_for(gradzip.codec("fp16 | aggregate=two_phase"), x, 8) == "two_phase"
    # the probe that measured sizes left no state behind
    assert qsgd.state.records == {}


def test_two_phase_sums_low_precision_payloads_in_fp32():
    """fp16 payloads all-reduced add up in fp16; the two-phase owner adds in fp32."""
    world, n = 16, 4096

    def error(path: str) -> float:
        def work(rank, comm):
            c = gradzip.codec(f"fp16 | aggregate={path}" if path != "all_reduce" else "fp16",
                              rank=rank)
            return reduce(c, _inputs(rank, n) * 100, "w", comm)[0]

        exact = sum(_inputs(r, n).double() * 100 for r in range(world)) / world
        return float((run_simulated(world, work)[0].double() - exact).norm() / exact.norm())

    assert error("two_phase") < error("all_reduce") / 1.5


@pytest.mark.parametrize("spec", ["none", "fp16", "none | zstd", "qsgd", "ef | topk(ratio=0.5)",
                                  "int8(shared=narrow)"])
def test_reduce_scatter_on_simulated_ranks(spec):
    """FSDP's reduce-scatter runs on any Communicator: row ``rank`` of the sum."""
    world, n = 4, 300
    rows = {r: torch.stack([_inputs(10 * r + j, n) for j in range(world)]) for r in range(world)}

    def work(rank, comm):
        c = gradzip.codec(spec, rank=rank)
        return reduce_scatter(c, rows[rank], "fsdp", comm)

    results = run_simulated(world, work)
    for rank, out in enumerate(results):
        exact = sum(rows[r][rank] for r in range(world))
        rel = float((out - exact).norm() / exact.norm())
        limit = {"none": 1e-6, "none | zstd": 1e-6, "fp16": 1e-3}.get(spec, 0.8)
        assert out.shape == (n,) and rel < limit, (spec, rel)


def test_observer_sees_every_encode_decode_and_the_path():
    class Seen(CodecObserver):
        def __init__(self):
            self.encodes, self.decodes, self.paths = 0, 0, []

        def encoded(self, numel, payload, seconds):
            self.encodes += 1

        def decoded(self, seconds):
            self.decodes += 1

        def aggregated(self, path):
            self.paths.append(path)

    def work(rank, comm):
        c = gradzip.codec("qsgd | aggregate=two_phase", rank=rank)
        c.observer = seen = Seen()
        reduce(c, _inputs(rank, 100), "w", comm)
        return seen.encodes, seen.decodes, seen.paths

    for encodes, decodes, paths in run_simulated(3, work):
        # 3 chunks sent + 1 owner payload; 3 received chunks + 3 gathered chunks
        assert (encodes, decodes, paths) == (4, 6, ["two_phase"])


def test_state_methods_residual_norm_and_drop():
    c = gradzip.codec("ef | topk(ratio=0.1)")
    c.encode(torch.randn(100), key="bucket0/p0")
    c.encode(torch.randn(100), key="bucket0/p1")
    c.encode(torch.randn(100), key="bucket1")
    r0 = c.state.slot(0, "bucket0/p0").data["residual"]
    r1 = c.state.slot(0, "bucket0/p1").data["residual"]
    assert c.residual_norm("bucket0") == pytest.approx(float(torch.cat([r0, r1]).norm()))
    assert c.residual_norm("bucket9") is None
    assert c.drop("bucket0") == 4  # ef and topk records of both keys
    assert c.state.keys() == ["bucket1"]


def test_link_model_per_collective():
    assert link_bytes("all_reduce", 1000, 4) == 1500
    assert link_bytes("all_gather", 1000, 4) == 3000
    assert link_bytes("reduce_scatter", 1000, 4) == 750
    assert link_bytes("all_to_all", 1000, 4) == 750
    assert link_bytes("broadcast", 1000, 4) == 750
    assert all(link_bytes(op, 1000, 1) == 0 for op in ("all_reduce", "all_gather"))
    with pytest.raises(ValueError, match="unknown collective"):
        link_bytes("gossip", 1, 2)


def _every_single_round_spec() -> list[str]:
    from gradzip.codecs.base import Compressor, LosslessCoder
    from gradzip.codecs.registry import registered

    specs = []
    for name, cls in sorted(registered().items()):
        if issubclass(cls, LosslessCoder):
            specs.append(f"qsgd | {name}")
        elif issubclass(cls, Compressor) and not cls(**{}).multi_round:
            specs.append(name)
    return specs


@pytest.mark.parametrize("spec", _every_single_round_spec())
def test_every_codec_aggregates_in_two_phases(spec):
    world, n = 3, 2000
    shapes = [torch.Size((20, 40)), torch.Size((1200,))]

    def work(rank, comm):
        c = gradzip.codec(f"{spec} | aggregate=two_phase", rank=rank)
        return reduce(c, _inputs(rank, n), "w", comm, shapes=shapes)[0]

    means = run_simulated(world, work)
    for mean in means:
        assert mean.shape == (n,) and bool(torch.isfinite(mean).all())
        torch.testing.assert_close(mean, means[0])  # every rank holds the same mean


def test_gloo_link_model():
    """gloo's reduce-scatter is a ring all-reduce, and every call adds its transport."""
    from gradzip.collectives.linkmodel import GLOO_CALL_BYTES

    n, w = 1 << 20, 4
    assert link_bytes("reduce_scatter", n, w, "gloo") == link_bytes("all_reduce", n, w, "gloo")
    assert (link_bytes("all_gather", n, w, "gloo")
            == link_bytes("all_gather", n, w) + 3 * GLOO_CALL_BYTES["all_gather"])
    assert link_bytes("all_reduce", n, 1, "gloo") == 0
    with pytest.raises(ValueError, match="unknown link model"):
        link_bytes("all_reduce", n, w, "mpi")


def test_chain_options_in_the_spec():
    c = gradzip.codec("ef | qsgd | aggregate=two_phase")
    assert c.aggregate == "two_phase" and str(c) == "ef | qsgd | aggregate=two_phase"
    assert gradzip.codec(str(c)).aggregate == "two_phase"
    assert gradzip.codec(c.to_json()).aggregate == "two_phase"
    assert gradzip.codec("qsgd").to_json() == [{"name": "qsgd", "levels": 16, "bucket": 512}]
    for bad, message in [("qsgd | aggregate=ring", "aggregate must be one of"),
                         ("aggregate=gather | qsgd", "go at the end"),
                         ("qsgd | agg=gather", "unknown chain option")]:
        with pytest.raises(gradzip.SpecError, match=message):
            gradzip.codec(bad)
