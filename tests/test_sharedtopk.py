"""``sharedtopk``: one rotating leader's positions for every rank, the values summed.

Over simulated groups of 3 and 5 ranks (where W matters): every rank gets the same mean,
which is the exact mean of the inputs (to the 16-bit sum) at the leader's top-k of every
chunk and zero elsewhere; the leader rotates; error feedback keeps the rest; the link
bytes per rank do not grow with W; bytes from a peer are checked.
"""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.aggregation import reduce
from gradzip.codecs.chain import CodecObserver
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.sharedtopk import kept_count, kept_per_chunk, leader_of, position_bits
from gradzip.codecs.sparse import chunked_topk_positions
from gradzip.collectives.communicator import Communicator
from gradzip.collectives.linkmodel import link_bytes
from gradzip.collectives.simulated import SimulatedCommunicator, run_simulated, simulated_group
from gradzip.comm.method import sparseloco_codec

N, K, CHUNK = 5000, 8, 1024


def _inputs(world: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + world)
    return [torch.randn(N, generator=g) for _ in range(world)]


@pytest.mark.parametrize("world", [3, 5])
def test_every_rank_gets_the_mean_at_the_leaders_positions(world: int) -> None:
    xs = _inputs(world, 0)
    leader = leader_of("w", 0, world)

    def work(rank, comm):
        c = gradzip.codec(f"sharedtopk(k={K}, chunk={CHUNK}, values=fp32)", rank=rank)
        return reduce(c, xs[rank], "w", comm, want_local=True)

    results = run_simulated(world, work)
    where = chunked_topk_positions(xs[leader], CHUNK, K)
    expected = torch.zeros(N)
    expected[where] = torch.stack(xs)[:, where].mean(0)
    for rank, (mean, local) in enumerate(results):
        assert torch.equal(mean, results[0][0])
        torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-7)
        own = torch.zeros(N)
        own[where] = xs[rank][where]
        torch.testing.assert_close(local, own, rtol=1e-6, atol=1e-7)
    assert int((results[0][0] != 0).sum()) == kept_count(N, CHUNK, K)


def test_the_leader_turns_with_every_exchange_and_differs_between_tensors() -> None:
    assert [leader_of("w", step, 4) for step in range(8)] == \
        [(leader_of("w", 0, 4) + step) % 4 for step in range(8)]
    assert len({leader_of(f"bucket{j}", 0, 7) for j in range(20)}) > 1


def test_error_feedback_sends_every_rank_s_large_entry_in_turn() -> None:
    """Each rank has its own large entry, given once; under ``ef`` each is sent in full
    when its rank leads (within W exchanges), and then nothing is left behind."""
    world = 3

    def work(rank, comm):
        c = gradzip.codec(f"ef | sharedtopk(k=1, chunk={N}, values=fp32)", rank=rank)
        x = torch.zeros(N)
        x[100 * (rank + 1)] = 1.0
        total = torch.zeros(N)
        for step in range(world):
            total += reduce(c, x if step == 0 else torch.zeros(N), "w", comm)[0]
        return total, float(c.residual_sq("w").sum())

    results = run_simulated(world, work)
    spikes = [100 * (rank + 1) for rank in range(world)]
    for total, left in results:
        assert torch.equal(total, results[0][0]) and left == 0.0
        assert total[spikes].tolist() == pytest.approx([1 / world] * world)
        assert int((total != 0).sum()) == world


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_link_bytes_per_rank_do_not_grow_with_the_number_of_ranks(world: int) -> None:
    def work(rank, comm):
        c = gradzip.codec(f"sharedtopk(k={K}, chunk={CHUNK})", rank=rank)
        reduce(c, _inputs(world, 1)[rank], "w", comm)
        return dict(comm.counter.wire)

    wire = run_simulated(world, work)[0]
    kept = kept_count(N, CHUNK, K)
    index_bytes = (kept * position_bits(N, CHUNK) + 7) // 8
    assert wire == {"broadcast": link_bytes("broadcast", index_bytes, world),
                    "all_reduce": link_bytes("all_reduce", 2 * kept, world)}
    assert sum(wire.values()) < index_bytes + 4 * kept  # < one position and 2 values each


def test_alone_it_is_a_chunked_top_k_in_sixteen_bits() -> None:
    x = _inputs(1, 2)[0]
    c = gradzip.codec(f"sharedtopk(k={K}, chunk={CHUNK})")
    p = c.encode(x, "w")
    y = c.decode(Payload.deserialize(p.serialize()))
    where = chunked_topk_positions(x, CHUNK, K)
    assert torch.equal(y[where], x[where].half().float())
    assert int((y != 0).sum()) == where.numel()


def test_positions_from_a_peer_are_checked() -> None:
    c = gradzip.codec(f"sharedtopk(k={K}, chunk={CHUNK})")
    x = torch.randn(1100)  # a full chunk and a short one of 76 entries
    p = c.encode(x, "w")
    bad = p.tensor("positions").clone()
    bad[-2:] = 255  # offsets past the short chunk's end
    with pytest.raises(PayloadError, match="beyond the end of its chunk"):
        c.decode(Payload({**p.fields, "positions": bad}, dict(p.meta)))
    with pytest.raises(PayloadError, match="position bytes"):
        c.decode(Payload({**p.fields, "positions": bad[:-1]}, dict(p.meta)))


def test_sixteen_bit_sums_saturate_instead_of_overflowing() -> None:
    world = 4

    def work(rank, comm):
        c = gradzip.codec("sharedtopk(k=4, chunk=64)", rank=rank)
        return reduce(c, torch.full((64,), 1e5), "w", comm)[0]  # 1e5 / 4 > 65504 / 4

    mean = run_simulated(world, work)[0]
    assert torch.isfinite(mean).all() and float(mean.max()) == pytest.approx(65504, rel=1e-3)


@pytest.mark.parametrize("world", [3, 8])
def test_int8_values_share_a_scale_per_chunk_and_cannot_overflow(world: int) -> None:
    """``values=int8``: every rank rounds against the chunk's largest magnitude over all
    ranks to 127 // W levels, so the int8 sum stays in range; the mean errs by at most
    half a step; each rank's ``local`` is what it sent (error feedback keeps the rest)."""
    xs = _inputs(world, 3)
    xs[0][7] = 1e3  # one rank's outlier sets chunk 0's scale for all

    def work(rank, comm):
        c = gradzip.codec(f"sharedtopk(k={K}, chunk={CHUNK}, values=int8)", rank=rank)
        return reduce(c, xs[rank], "w", comm, want_local=True), dict(comm.counter.wire)

    results = run_simulated(world, work)
    where = chunked_topk_positions(xs[leader_of("w", 0, world)], CHUNK, K)
    stacked = torch.stack(xs)[:, where]
    chunk_of = where // CHUNK
    amax = torch.zeros(-(-N // CHUNK)).scatter_reduce(0, chunk_of, stacked.abs().amax(0),
                                                      "amax")
    step = (amax / (127 // world))[chunk_of]
    for rank, ((mean, local), _) in enumerate(results):
        assert torch.equal(mean, results[0][0][0])
        assert bool(((mean[where] - stacked.mean(0)).abs() <= step / 2 + 1e-6).all())
        assert bool(((local[where] - xs[rank][where]).abs() <= step / 2 + 1e-6).all())
    kept = where.numel()
    wire = results[0][1]
    assert wire["all_reduce"] == link_bytes("all_reduce", kept, world) + \
        link_bytes("all_reduce", 4 * amax.numel(), world)


def test_int8_values_alone_decode_from_their_scales_and_refuse_bad_ones() -> None:
    c = gradzip.codec(f"sharedtopk(k={K}, chunk={CHUNK}, values=int8)")
    x = _inputs(1, 4)[0]
    p = c.encode(x, "w")
    y = c.decode(Payload.deserialize(p.serialize()))
    where = chunked_topk_positions(x, CHUNK, K)
    step = p.tensor("scale")[where // CHUNK]
    assert bool(((y[where] - x[where]).abs() <= step / 2 + 1e-7).all())
    assert int((y != 0).sum()) <= where.numel()
    bad = p.tensor("scale").clone()
    bad[0] = float("inf")
    with pytest.raises(PayloadError, match="finite float32"):
        c.decode(Payload({**p.fields, "scale": bad}, dict(p.meta)))


@pytest.mark.parametrize("world", [3, 5])
def test_select_each_uses_the_union_of_every_rank_s_share(world: int) -> None:
    """``select=each``: every rank's own top ceil(k / W) of each chunk, all-gathered;
    the mean is exact on the union and zero elsewhere, the same on every rank."""
    xs = _inputs(world, 5)

    def work(rank, comm):
        c = gradzip.codec(f"sharedtopk(k={K}, chunk={CHUNK}, values=fp32, select=each)",
                          rank=rank)
        return reduce(c, xs[rank], "w", comm, want_local=True), dict(comm.counter.wire)

    results = run_simulated(world, work)
    share = -(-K // world)
    union = torch.unique(torch.cat([chunked_topk_positions(x, CHUNK, share) for x in xs]))
    expected = torch.zeros(N)
    expected[union] = torch.stack(xs)[:, union].mean(0)
    for rank, ((mean, local), _) in enumerate(results):
        assert torch.equal(mean, results[0][0][0])
        torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(local[union], xs[rank][union])
        assert int((local != 0).sum()) == union.numel()
    packed = (sum(k for _, _, k in kept_per_chunk(N, CHUNK, share))
              * position_bits(N, CHUNK) + 7) // 8
    flag = 1  # the agreed non-finite flag rides on the first collective, one byte here
    assert results[0][1] == {"all_gather": link_bytes("all_gather", packed + flag, world),
                             "all_reduce": link_bytes("all_reduce", 4 * union.numel(), world)}


def test_kept_per_chunk_cuts_a_short_last_chunk() -> None:
    assert kept_per_chunk(2100, 1024, 64) == [(0, 1024, 64), (1024, 1024, 64), (2048, 52, 52)]
    assert kept_count(2100, 1024, 64) == 180 and kept_count(0, 1024, 64) == 0


def test_a_transport_without_a_broadcast_sends_and_counts_an_all_reduce() -> None:
    """torchft's transport has no broadcast: the base class's stand-in must deliver the
    source's tensor and count the all-reduce's bytes, not a broadcast's."""

    class NoBroadcast(SimulatedCommunicator):
        _broadcast = Communicator._broadcast

    def work(rank, comm):
        plain = NoBroadcast(rank, comm._ex)
        out = plain.broadcast(torch.full((40,), float(rank + 1)), src=2)
        return out, dict(plain.counter.wire)

    results = run_simulated(3, work)
    for out, wire in results:
        assert torch.equal(out, torch.full((40,), 3.0))
        assert wire == {"all_reduce": link_bytes("all_reduce", 160, 3)}


def test_broadcast_refuses_a_source_outside_the_group() -> None:
    comm = simulated_group(2)[0]
    with pytest.raises(ValueError, match=r"broadcast source must be in \[0, 2\), got 2"):
        comm.broadcast(torch.zeros(3), src=2)
    assert torch.equal(simulated_group(1)[0].broadcast(torch.ones(2), 0), torch.ones(2))


def test_the_sparseloco_builder_refuses_bits_it_cannot_sum() -> None:
    assert sparseloco_codec(aggregate="shared", bits=8).endswith("values=int8, select=each)")
    with pytest.raises(ValueError, match="sums values in 16 or 8 bits, got 3"):
        sparseloco_codec(aggregate="shared", bits=3)



class _Sent(CodecObserver):
    """What a codec told its observer (the hooks' statistics) it encoded."""

    def __init__(self) -> None:
        self.payloads: list[tuple[int, Payload]] = []

    def encoded(self, numel: int, payload: Payload, seconds: float) -> None:
        self.payloads.append((numel, payload))


@pytest.mark.parametrize("world", [3, 5])
@pytest.mark.parametrize(("select", "values"), [("each", "int8"), ("leader", "fp16")])
def test_each_rank_reports_what_it_sent_for_the_statistics(world: int, select: str,
                                                            values: str) -> None:
    """The statistics' bits per kept value and density come from the payload a rank
    reports (``Slot.sent``): its own positions (each: its top ceil(k/W) of every chunk;
    leader: all k, or none), the values it put into the all-reduce at the agreed
    positions, and with int8 its float scale per chunk."""
    xs = _inputs(world, 1)
    spec = f"ef | sharedtopk(k={K}, chunk={CHUNK}, select={select}, values={values})"

    def work(rank: int, comm: Communicator) -> tuple[torch.Tensor, list]:
        c = gradzip.codec(spec, rank=rank)
        c.observer = _Sent()
        mean, _ = reduce(c, xs[rank], "w", comm, want_local=False)
        return mean, c.observer.payloads

    results = run_simulated(world, work)
    agreed = int((results[0][0] != 0).sum())
    bits, chunks = position_bits(N, CHUNK), -(-N // CHUNK)
    leader = leader_of("w", 0, world)
    for rank, (_, reported) in enumerate(results):
        [(numel, sent)] = reported
        assert numel == N and sent.tensor("values").numel() == agreed
        assert sent.tensor("values").dtype == (torch.int8 if values == "int8"
                                               else torch.float16)
        own = kept_count(N, CHUNK, -(-K // world)) if select == "each" else \
            kept_count(N, CHUNK, K) if rank == leader else 0
        assert sent.tensor("positions").numel() == -(-own * bits // 8)
        if values == "int8":
            assert sent.tensor("scale").numel() == chunks



def test_the_statistics_count_a_multi_round_payload_by_its_tensors_not_framing() -> None:
    """A multi-round stage sends its tensors raw through collectives: the serialised
    payload's framing (magic, digest, field names) never crosses, so it is not counted
    as value bits; a payload that is serialised is counted as it crosses."""
    from gradzip.comm.reducer import Reducer
    from gradzip.comm.stats import CommStats

    p = Payload({"positions": torch.zeros(3, dtype=torch.uint8),
                 "values": torch.zeros(4, dtype=torch.float16)})
    assert Reducer(gradzip.codec("ef | sharedtopk"), CommStats())._made_bytes(p) == 3 + 8
    assert Reducer(gradzip.codec("int8"), CommStats())._made_bytes(p) == p.wire_bytes > 11
