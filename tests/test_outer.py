"""DiLoCo (``gradzip.comm.outer``) on 2 gloo ranks: the averaging control equals
synchronous SGD, state survives a checkpoint exactly, bytes are counted, bad options fail."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gradzip.comm.launch import run_ranks
from gradzip.comm.outer import DiLoCo, check_options, fragment_indices

pytestmark = pytest.mark.dist


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _inner(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = _batch(step, rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _average_h1_vs_ddp(rank: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = copy.deepcopy(_model())
    outer = DiLoCo(local, sync_every=1, outer="average")
    opt = torch.optim.SGD(local.parameters(), lr=0.05)
    ddp = DDP(copy.deepcopy(_model()))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(6):
        _inner(local, opt, step, rank)
        assert outer.step()
        _inner(ddp, ddp_opt, step, rank)
    return max(float((a - b).abs().max())
               for a, b in zip(local.parameters(), ddp.parameters(), strict=True))


def test_averaging_every_step_is_synchronous_sgd() -> None:
    assert all(diff < 1e-6 for diff in run_ranks(_average_h1_vs_ddp, 2))


def _train(rank: int, steps: range, model: nn.Module, outer: DiLoCo,
           opt: torch.optim.Optimizer) -> None:
    for step in steps:
        _inner(model, opt, step, rank)
        outer.step()
        outer.stats.end_step()  # as the trainer does every step (the hooks' contract)


def _resume_is_exact(rank: int, spec: str) -> tuple[bool, int, int, int]:
    whole = copy.deepcopy(_model())
    w_outer = DiLoCo(whole, sync_every=3, codec=spec)
    w_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    _train(rank, range(10), whole, w_outer, w_opt)

    first = copy.deepcopy(_model())
    f_outer = DiLoCo(first, sync_every=3, codec=spec)
    f_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(rank, range(4), first, f_outer, f_opt)  # stop between sync boundaries
    saved = (copy.deepcopy(f_outer.state_dict()), copy.deepcopy(f_opt.state_dict()))

    second = copy.deepcopy(_model())  # a fresh process would start from the same init
    s_outer = DiLoCo(second, sync_every=3, codec=spec)
    s_opt = torch.optim.AdamW(second.parameters(), lr=1e-2)
    s_outer.load_state_dict(saved[0])
    s_opt.load_state_dict(saved[1])
    _train(rank, range(4, 10), second, s_outer, s_opt)
    same = all(torch.equal(a, b) for a, b in zip(whole.parameters(), second.parameters(),
                                                 strict=True))
    totals = w_outer.stats.totals()
    return same, s_outer.syncs, totals["bytes_wire"], totals["bytes_raw"]


@pytest.mark.parametrize("spec", [None, "ef | topk(ratio=0.25)"])
def test_resume_across_a_sync_boundary_is_bit_exact(spec: str | None) -> None:
    for same, syncs, wire, raw in run_ranks(_resume_is_exact, 2, spec):
        assert same and syncs == 3  # steps 3, 6 and 9
        n = sum(p.numel() for p in _model().parameters())
        assert raw >= 3 * 4 * n  # three fp32 all-reduces of the pseudo-gradient (+ transport)
        assert (wire == raw) if spec is None else (wire < raw)


@pytest.mark.parametrize("args, message", [
    ((0, 0.7, 0.9, "diloco"), "sync_every"),
    ((8, 0.0, 0.9, "diloco"), "outer lr"),
    ((8, 0.7, 1.0, "diloco"), "momentum"),
    ((8, 0.7, 0.9, "streaming"), "outer must be one of"),
])
def test_bad_options_are_clear_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_options(*args)


@pytest.mark.parametrize("args, message", [
    ((8, 0.7, 0.9, "diloco", 0), "fragments must be in"),
    ((4, 0.7, 0.9, "diloco", 5), "fragments must be in"),
])
def test_bad_fragment_counts_are_clear_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_options(*args)


_NAMES = ["emb.weight", "blocks.0.w", "blocks.0.b", "blocks.1.w", "blocks.2.w",
          "blocks.3.w", "norm.weight", "head.weight"]


def test_fragments_are_consecutive_blocks_with_the_outer_parameters_nearest() -> None:
    assert fragment_indices(_NAMES, 1) == [list(range(8))]
    assert fragment_indices(_NAMES, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert fragment_indices(_NAMES, 4) == [[0, 1, 2], [3], [4], [5, 6, 7]]
    with pytest.raises(ValueError, match=r"does not divide the model's 4 blocks: choose one "
                                         r"of \[1, 2, 4\]"):
        fragment_indices(_NAMES, 3)
    with pytest.raises(ValueError, match="numbered blocks"):
        fragment_indices(["0.weight", "2.weight"], 2)


class _Blocks(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


def _fragment_schedule(rank: int) -> list[list[int]]:
    """Per inner step, the fragments whose weights are equal on both ranks right after
    it (ranks train on different data, so only what was just synchronized agrees)."""
    import torch.distributed as dist

    model = _Blocks()
    outer = DiLoCo(model, sync_every=4, codec="int8", fragments=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    agree: list[list[int]] = []
    for step in range(8):
        _inner(model, opt, step, rank)
        outer.step()
        outer.stats.end_step()
        same = []
        for idx in outer.fragments:
            mine = torch.cat([outer.params[i].detach().reshape(-1) for i in idx])
            other = mine.clone()
            dist.broadcast(other, src=0)
            same.append(bool(torch.equal(mine, other)))
        agree.append([f for f, s in enumerate(same) if s])
    return agree


def test_fragments_are_synchronized_on_their_staggered_schedule() -> None:
    # H = 4, F = 2: fragment 0 at steps 4 and 8, fragment 1 (offset 2) at steps 2 and 6
    expected = [[], [1], [], [0], [], [1], [], [0]]
    assert run_ranks(_fragment_schedule, 2)[1] == expected  # rank 1 against rank 0's


def _fragment_resume(rank: int, codec: Any = "ef | int8") -> bool:
    whole = _Blocks()
    w_outer = DiLoCo(whole, sync_every=4, codec=codec, fragments=2)
    w_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    _train(rank, range(9), whole, w_outer, w_opt)
    first = _Blocks()
    f_outer = DiLoCo(first, sync_every=4, codec=codec, fragments=2)
    f_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(rank, range(3), first, f_outer, f_opt)  # after fragment 1's sync, before fragment 0's
    saved = (copy.deepcopy(f_outer.state_dict()), copy.deepcopy(f_opt.state_dict()))
    second = _Blocks()
    s_outer = DiLoCo(second, sync_every=4, codec=codec, fragments=2)
    s_opt = torch.optim.AdamW(second.parameters(), lr=1e-2)
    s_outer.load_state_dict(saved[0])
    s_opt.load_state_dict(saved[1])
    _train(rank, range(3, 9), second, s_outer, s_opt)
    with pytest.raises(ValueError, match="same --fragments"):
        DiLoCo(_Blocks(), sync_every=4, fragments=1).load_state_dict(saved[0])
    return all(torch.equal(a, b) for a, b in zip(whole.parameters(), second.parameters(),
                                                 strict=True))


@pytest.mark.parametrize("codec", ["ef | int8", ["ef | int8", "ef | centroid(bits=4)"]])
def test_fragment_state_survives_a_checkpoint_exactly(codec: Any) -> None:
    """One codec for both fragments (its state keyed by fragment), or one each."""
    assert all(run_ranks(_fragment_resume, 2, codec))


def _codec_per_fragment(rank: int) -> tuple[float, float]:
    model = _Blocks(width=128)  # large enough that gloo's framing is a small share
    outer = DiLoCo(model, sync_every=2, codec=["int8", "none"], fragments=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sent = []
    for step in range(2):  # fragment 1 (fp32) syncs after inner step 1, fragment 0 at 2
        before = outer.stats.totals()["bytes_wire"]
        _train(rank, range(step, step + 1), model, outer, opt)
        outer.stats.end_step()
        sent.append(outer.stats.totals()["bytes_wire"] - before)
    numels = [sum(outer.params[i].numel() for i in idx) for idx in outer.fragments]
    return sent[0] / numels[1], sent[1] / numels[0]


def test_each_fragment_crosses_the_link_through_its_own_codec() -> None:
    for fp32, int8 in run_ranks(_codec_per_fragment, 2):
        # link bytes per value: an fp32 all-reduce (4 at 2 ranks, plus gloo's framing),
        # then int8's (1, plus its scales, a second round and framing)
        assert 4 <= fp32 < 4.5 and int8 < 1.5, (fp32, int8)


def test_overlap_must_land_before_the_next_exchange() -> None:
    with pytest.raises(ValueError, match="overlap_steps must be in"):
        check_options(4, 0.7, 0.9, "diloco", 1, 4)
    with pytest.raises(ValueError, match="overlap_steps must be in"):
        check_options(4, 0.7, 0.9, "diloco", 1, -1)


def _overlap_schedule(rank: int) -> tuple[list[int], bool, bool]:
    """H = 4, F = 2, S = 1: exchanges start at 2 (fragment 1), 4 (0), 6 (1), 8 (0) and are
    applied one step later; the anchors agree on both ranks, and an applied fragment's
    weights are its new anchor plus the local step taken while the exchange ran."""
    import torch.distributed as dist

    model = _Blocks()
    outer = DiLoCo(model, sync_every=4, codec="int8", fragments=2, overlap_steps=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    syncs, kept_local = [], True
    for step in range(9):
        if step == 2:  # step 3 applies fragment 1's exchange started at step 2
            before = [outer.params[i].detach().clone() for i in outer.fragments[1]]
        _inner(model, opt, step, rank)
        if step == 2:
            local_step = [outer.params[i].detach() - b
                          for i, b in zip(outer.fragments[1], before, strict=True)]
        outer.step()
        outer.stats.end_step()
        syncs.append(outer.syncs)
        if step == 2:
            kept_local = all(torch.allclose(outer.params[i], outer.anchor[i] + d, atol=1e-6)
                             for i, d in zip(outer.fragments[1], local_step, strict=True))
    anchor = torch.cat([a.reshape(-1) for a in outer.anchor])
    other = anchor.clone()
    dist.broadcast(other, src=0)
    outer.close()
    return syncs, bool(torch.equal(anchor, other)), kept_local


def test_overlapped_exchanges_are_applied_steps_later() -> None:
    for syncs, anchors_agree, kept_local in run_ranks(_overlap_schedule, 2):
        assert syncs == [0, 0, 1, 1, 2, 2, 3, 3, 4]
        assert anchors_agree and kept_local


def _overlap_resume(rank: int) -> bool:
    from gradzip.outer import DiLoCo as PublicDiLoCo

    def build() -> tuple[nn.Module, DiLoCo, torch.optim.Optimizer]:
        model = _Blocks()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = PublicDiLoCo(model, opt, sync_every=4, codec="ef | int8", fragments=2,
                             overlap_steps=2)  # the inner optimizer's state is in its own
        return model, outer, opt

    whole = build()
    _train(rank, range(10), *whole)
    first = build()
    _train(rank, range(3), *first)  # fragment 1's exchange (started at 2) is still in flight
    assert len(first[1]._pending) == 1
    saved = copy.deepcopy(first[1].state_dict())
    assert "inner_optimizer" in saved
    second = build()
    second[1].load_state_dict(saved)
    _train(rank, range(3, 10), *second)
    for _, outer, _ in (whole, first, second):
        outer.close()
    if not _in_flight_resumes_beside_the_weights(saved):
        return False
    return all(torch.equal(a, b) for a, b in zip(whole[0].parameters(),
                                                 second[0].parameters(), strict=True))


def _in_flight_resumes_beside_the_weights(saved: dict[str, Any]) -> bool:
    """A checkpoint loads on the CPU; an exchange in flight must resume on the weights'
    device (meta stands in for a GPU: the outer step would mix devices)."""
    from gradzip.outer import DiLoCo as PublicDiLoCo

    model = _Blocks().to("meta")
    outer = PublicDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         sync_every=4, codec="ef | int8", fragments=2, overlap_steps=2)
    outer.load_state_dict(saved)
    pending = outer._pending[0]
    devices = {pending.future.result().device.type, *(t.device.type for t in pending.since)}
    outer.close()
    return devices == {"meta"}


def test_exchanges_in_flight_survive_a_checkpoint_exactly() -> None:
    assert all(run_ranks(_overlap_resume, 2))


def _alpha_mixing(rank: int) -> bool:
    model = _model()
    outer = DiLoCo(model, sync_every=2, outer="average", alpha=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(rank, range(1), model, outer, opt)
    _inner(model, opt, 1, rank)
    local = [p.detach().clone() for p in model.parameters()]
    mean = [t.clone() for t in local]
    for t in mean:
        torch.distributed.all_reduce(t)
        t /= 2
    assert outer.step()  # the sync: anchor = the ranks' mean (average: lr 1, no momentum)
    return all(torch.allclose(p, 0.25 * mine + 0.75 * m, atol=1e-6)
               for p, mine, m in zip(model.parameters(), local, mean, strict=True))


def test_alpha_mixes_the_local_weights_into_the_synchronized_ones() -> None:
    """Streaming DiLoCo's mixing: after the outer step, alpha * local + (1 - alpha) *
    synchronized, on every rank."""
    assert all(run_ranks(_alpha_mixing, 2))


def test_overlapped_exchanges_leave_nccl_for_gloo() -> None:
    """NCCL does not support two threads issuing collectives on two communicators in
    rank-dependent orders: an overlapped exchange beside NCCL runs on gloo."""
    from gradzip.comm.outer import exchange_backend

    assert exchange_backend("nccl") == "gloo"
    assert exchange_backend("nccl", overlap=False) == "nccl"
    assert exchange_backend("gloo") == "gloo"


def _threads_and_groups(rank: int, as_nccl: bool) -> dict[str, Any]:
    """Every collective after construction, by (thread, group); the main thread logs
    through an all-reduce on the world group each step, as the trainer does.
    ``as_nccl``: the model's group reports NCCL while DiLoCo is built (its exchanges
    then go through ``HostCommunicator`` on a gloo group of their own)."""
    import threading
    from unittest import mock

    import torch.distributed as dist

    from gradzip.comm import streams
    from gradzip.comm.communicator import HostCommunicator
    from gradzip.comm.outer import group_backend

    model = _Blocks()
    real = dist.get_backend_config
    assert group_backend(dist.group.WORLD) == "gloo"
    # what a default-less init_process_group() reports: "undefined" from get_backend
    with mock.patch.object(dist, "get_backend_config",
                           lambda g=None: "cpu:gloo,cuda:nccl" if as_nccl else real(g)):
        outer = DiLoCo(model, sync_every=4, codec="ef | int8", fragments=2,
                       overlap_steps=2)
    through_host = isinstance(outer.comm, HostCommunicator)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen: dict[str, set[int]] = {}
    adopted: list[int] = []
    saved = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "broadcast")}
    original_adopt = streams.SideStreams.adopt

    def record(name: str) -> Any:
        def collective(*args: Any, **kw: Any) -> Any:
            group = kw.get("group")
            seen.setdefault(threading.current_thread().name.split("_")[0], set()).add(
                id(group))
            return saved[name](*args, **kw)
        return collective

    for name in saved:
        setattr(dist, name, record(name))
    streams.SideStreams.adopt = staticmethod(  # type: ignore[method-assign]
        lambda t: adopted.append(1) or original_adopt(t))
    try:
        for step in range(9):
            _inner(model, opt, step, rank)
            outer.step()
            dist.all_reduce(torch.ones(1))  # the trainer's log all-reduce
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        streams.SideStreams.adopt = original_adopt  # type: ignore[method-assign]
    applied = outer.syncs
    anchor = torch.cat([a.reshape(-1) for a in outer.anchor])
    other = anchor.clone()
    dist.broadcast(other, src=0)
    outer.close()
    return {"seen": seen, "adopted": len(adopted), "applied": applied,
            "through_host": through_host, "anchors_agree": bool(torch.equal(anchor, other))}


@pytest.mark.parametrize("as_nccl", [False, True])
def test_the_exchange_thread_has_a_communicator_of_its_own(as_nccl: bool) -> None:
    """The thread/communicator audit: the exchange thread's collectives use groups the
    main thread never uses, and every mean it hands back is adopted by the consuming
    stream (``SideStreams.adopt``: the allocator keeps its block until the outer step
    read it). Beside NCCL the exchanges cross through the host, and the anchors still
    agree."""
    for out in run_ranks(_threads_and_groups, 2, as_nccl):
        seen = out["seen"]
        exchange = seen.pop("diloco-exchange")
        assert exchange and all(not (exchange & other) for other in seen.values()), seen
        assert out["applied"] > 0 and out["adopted"] == out["applied"]
        assert out["through_host"] == as_nccl and out["anchors_agree"]
