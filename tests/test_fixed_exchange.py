"""Fixed-layout payloads as equal-length buffers (``aggregation/fixed.py``): the same
sums as the byte path, the non-finite news on every rank, corrupt bytes caught without
touching memory outside the tensor, and no host read when the flags are deferred."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.aggregation import fixed, reduce, reduce_scatter
from gradzip.bench.devicecheck import count_host_syncs
from gradzip.codecs.chain import Codec
from gradzip.codecs.payload import PayloadError
from gradzip.codecs.validation import deferred_checks
from gradzip.collectives import run_simulated

SPECS = ["int8", "ef | topk(ratio=0.05)", "topk(ratio=0.01)", "qsgd", "topk(ratio=0.1) | int8",
         "centroid", "onebit", "int8(block=7)"]
SHAPES = [torch.Size((40, 9)), torch.Size((7,)), torch.Size((23,))]
N = 40 * 9 + 7 + 23


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(N, generator=g) * torch.randn(N, generator=g).exp()


def _run(spec: str, world: int, scatter: bool) -> list:
    def work(rank: int, comm: object) -> list:
        codec = gradzip.codec(spec, rank=rank)
        outs = []
        for step in range(3):
            x = _grad(rank, step)
            if scatter:
                outs.append(reduce_scatter(codec, x[: N // world * world].reshape(world, -1),
                                           "u", comm))
            else:
                outs.append(reduce(codec, x, "b", comm, want_local=True, shapes=SHAPES)[0])
        return outs, comm.counter.total_wire  # type: ignore[attr-defined]

    return run_simulated(world, work)


@pytest.mark.parametrize("scatter", [False, True], ids=["gather", "reduce_scatter"])
@pytest.mark.parametrize("spec", SPECS)
def test_the_fixed_path_sums_exactly_what_the_byte_path_sums(
        spec: str, scatter: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    world = 2 if not scatter else 3
    ours = _run(spec, world, scatter)
    with monkeypatch.context() as m:  # the byte path: sizes exchanged, payloads framed
        m.setattr(Codec, "fixed_layout", property(lambda self: False))
        bytes_path = _run(spec, world, scatter)
    for rank in range(world):
        for a, b in zip(ours[rank][0], bytes_path[rank][0], strict=True):
            assert torch.equal(a, b), (spec, rank)
        # no size exchange and no frame: never more on the wire
        assert ours[rank][1] <= bytes_path[rank][1], (spec, ours[rank][1], bytes_path[rank][1])


@pytest.mark.parametrize("spec", ["int8", "ef | topk(ratio=0.05)"])
@pytest.mark.parametrize("scatter", [False, True], ids=["gather", "reduce_scatter"])
def test_a_nan_on_one_rank_raises_on_every_rank_and_no_state_holds_it(spec: str,
                                                                     scatter: bool) -> None:
    def work(rank: int, comm: object) -> tuple:
        codec = gradzip.codec(spec, rank=rank)
        x = _grad(rank, 0)
        if rank == 1:
            x[5] = float("nan")
        try:
            if scatter:
                reduce_scatter(codec, x[:N // 2 * 2].reshape(2, -1), "u", comm)
            else:
                reduce(codec, x, "b", comm, shapes=SHAPES)
            error = ""
        except gradzip.NonFiniteGradientError as e:
            error = str(e)
        state = [t for rec in codec.state.records.values() for t in rec["data"].values()
                 if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return error, all(bool(torch.isfinite(t).all()) for t in state)

    out = run_simulated(2, work)
    assert out[0][0] and out[0][0] == out[1][0], out
    assert all(clean for _, clean in out)


def test_deferred_flags_are_read_once_later_not_during_the_reduction() -> None:
    """A hook on a GPU defers the flags (``Communicator.deferred``): the reduction itself
    reads nothing on the host, and the deferred flag says what an immediate read would."""

    def work(rank: int, comm: object) -> list:
        pending: list = []
        comm.deferred = lambda flag, error: pending.append((flag, error))  # type: ignore[attr-defined]
        codec = gradzip.codec("ef | topk(ratio=0.05)", rank=rank)
        x = _grad(rank, 0)
        if rank == 0:
            x[3] = float("inf")
        reduce(codec, x, "b", comm, shapes=SHAPES)
        return pending

    with count_host_syncs() as syncs:  # both ranks' threads, one count
        out = run_simulated(2, work)
    assert syncs.total == 0, syncs.counts
    for pending in out:
        assert len(pending) == 1  # the senders' flags and the decoders' checks, in one
        raised = [str(error()) for flag, error in pending if bool(flag)]
        assert len(raised) == 1 and "non-finite" in raised[0]


def _frame_of(spec: str, n: int = 4096) -> tuple:
    codec = gradzip.codec(spec)
    p = codec.encode_body(_grad(0, 0)[:1] * 0 + torch.randn(n), "k", None)
    frame = fixed.Frame.of(p)
    return codec, p, frame, frame.pack(p, torch.zeros((), dtype=torch.bool))


@pytest.mark.parametrize("spec, field", [("topk(ratio=0.01)", "deltas"),
                                         ("topk(ratio=0.1)", "bitmap")])
def test_corrupt_positions_are_caught_later_and_write_nowhere_outside(spec: str,
                                                                      field: str) -> None:
    codec, p, frame, blob = _frame_of(spec)
    names = [name for name, _ in p.leaves()]
    offset, dtype, shape = frame.spans[names.index(field)]
    corrupt = blob.clone()
    view = corrupt[offset:offset + shape.numel() * dtype.itemsize].view(dtype)
    view[-1] = 2**30 if field == "deltas" else 255  # past the end / extra positions
    if field == "bitmap":
        view[:] = 255
    q, flag = frame.unpack(corrupt, p)
    assert not bool(flag)
    with deferred_checks() as checks:
        out = codec.decode_body(q, None, torch.Size((4096,)), None)
    assert out.shape == (4096,)
    assert bool(checks.failed(out.device))
    with deferred_checks() as checks:  # the intact buffer passes the same checks
        codec.decode_body(frame.unpack(blob, p)[0], None, torch.Size((4096,)), None)
    assert not bool(checks.failed(out.device))
    with pytest.raises(PayloadError):  # outside the context: checked at once, as before
        codec.decode_body(q, None, torch.Size((4096,)), None)


def test_a_buffer_of_the_wrong_length_is_refused() -> None:
    _, p, frame, blob = _frame_of("int8")
    with pytest.raises(PayloadError, match="fixed-layout buffer"):
        frame.unpack(blob[:-8], p)


def test_the_flag_byte_round_trips() -> None:
    _, p, frame, _ = _frame_of("int8")
    blob = frame.pack(p, torch.ones((), dtype=torch.bool))
    q, flag = frame.unpack(blob, p)
    assert bool(flag)
    for (_, a), (_, b) in zip(q.leaves(), p.leaves(), strict=True):
        assert torch.equal(a, b)
