"""The hook paths with no host read (issue 41, item 9), on CPU proxies: flags read once
per backward (``comm/pending.py``) and collectives timed by events
(``eventtimes.split_codec_time``)."""

from __future__ import annotations

import pytest
import torch
from event_helpers import FakeEvent

from gradzip.bench.devicecheck import count_host_syncs
from gradzip.comm.eventtimes import EventTimings, split_codec_time
from gradzip.comm.pending import AtBackwardEnd, PendingChecks
from gradzip.comm.stats import CommStats, Reduction


def _reduction(paths: list[str]) -> Reduction:
    return Reduction(numel=8, sent_values=8, bytes_raw=32, paths=paths,
                     calls_by_op={"all_gather": 2, "all_reduce": 1})


def test_collective_events_set_comm_encode_and_decode_times() -> None:
    """A gather of two collectives between an encode and a decode: each op's seconds
    from its own events, the decode after the last one, the encode the rest."""
    r = _reduction(["gather"])
    comms = [("all_gather", FakeEvent(3.0), FakeEvent(5.0)),
             ("all_reduce", FakeEvent(5.5), FakeEvent(6.0)),
             ("all_gather", FakeEvent(6.0), FakeEvent(10.0))]
    split_codec_time(r, (FakeEvent(0.0), FakeEvent(12.0)), comms)
    assert r.seconds_by_op == pytest.approx({"all_gather": 0.006, "all_reduce": 0.0005})
    assert r.extra_collective_s == pytest.approx(0.0025)  # all but the longest call
    assert r.decode_s == pytest.approx(0.002)
    assert r.encode_s == pytest.approx(0.012 - 0.0065 - 0.002)


def test_a_plain_reduction_keeps_no_codec_time() -> None:
    r = _reduction(["plain"])
    split_codec_time(r, (FakeEvent(0.0), FakeEvent(4.0)),
                     [("all_reduce", FakeEvent(1.0), FakeEvent(3.0))])
    assert r.encode_s == 0.0 and r.decode_s == 0.0
    assert r.seconds_by_op == pytest.approx({"all_reduce": 0.002})


def test_event_timed_reductions_wait_for_the_step_to_settle() -> None:
    stats, timings = CommStats(), EventTimings()
    stats.add_settler(timings.settle)
    timings.later(_reduction(["gather"]), stats, span=(FakeEvent(0.0), FakeEvent(8.0)),
                  comms=[("all_gather", FakeEvent(2.0), FakeEvent(6.0))])
    assert stats.open_reductions() == 1
    stats.end_step()
    assert stats.open_reductions() == 0
    assert stats.totals()["comm_ms_by_op"]["all_gather"] == pytest.approx(4.0)
    # the step's communication time is the collective's, not the encode and decode's
    assert stats.totals()["comm_ms"] == pytest.approx(4.0)


def test_flags_wait_for_one_read_when_host_reads_cost_a_sync() -> None:
    """Counted as a GPU: ``watch`` reads nothing; ``raise_ready`` reads every flag in
    one read, and raises the first set flag's error."""
    checks = PendingChecks()
    with count_host_syncs() as syncs:
        for i in range(5):
            checks.watch(torch.tensor(i == 3), lambda i=i: ValueError(f"flag {i}"))
        watched = syncs.total
        with pytest.raises(ValueError, match="flag 3"):
            checks.raise_ready()
    assert watched == 0
    with count_host_syncs() as syncs:
        for _ in range(5):
            checks.watch(torch.tensor(False), lambda: ValueError("never"))
        checks.raise_ready()  # all clear: one read
    assert syncs.total == 1
    checks.raise_ready()  # nothing pending: nothing read


def test_a_cpu_flag_raises_at_once_where_reads_are_free() -> None:
    with pytest.raises(ValueError, match="now"):
        PendingChecks().watch(torch.tensor(True), lambda: ValueError("now"))


def test_flags_are_read_when_backward_ends_before_the_step_can_use_them() -> None:
    """``AtBackwardEnd``: the first reduction of a backward queues one callback; a set
    flag raises out of ``backward()`` itself, so no optimizer step applies the result."""
    end = AtBackwardEnd()
    armed = []
    w = torch.ones(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        end.arm()
        armed.append(1)
        end.checks.watch(~torch.isfinite(grad).all(), lambda: ValueError("NaN grad"))
        return grad

    w.register_hook(hook)
    with count_host_syncs():  # the device path: deferred to the callback
        (w * 2).sum().backward()
        with pytest.raises(ValueError, match="NaN grad"):
            (w * float("nan")).sum().backward()
    (w * 3).sum().backward()  # a fresh backward: nothing left over
    assert len(armed) == 3
    end.arm()  # outside backward: nothing queued, nothing raised


def test_a_reduction_timed_by_events_keeps_the_codec_from_waiting_on_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a codec's ``Clock`` waits for its second event: on the autograd thread
    that would be a host sync per encode and decode. Inside a reduction the reducer
    times by events (a hook's), the codec is told to report host time instead."""
    import gradzip
    from gradzip.codecs import chain
    from gradzip.comm.reducer import Reducer

    devices: list[object] = []

    class Recording:
        def __init__(self, device: object) -> None:
            devices.append(device)

        def seconds(self) -> float:
            return 0.0

    monkeypatch.setattr(chain, "Clock", Recording)
    codec = gradzip.codec("int8")
    reducer = Reducer(codec, CommStats())
    x = torch.randn(64)
    codec.decode_body(codec.encode_body(x, "k"), "k", x.shape)
    reducer._span_start = object()  # what ``_begin`` sets when events time the reduction
    codec.decode_body(codec.encode_body(x, "k"), "k", x.shape)
    assert devices == [x.device, x.device, None, None]


def test_a_required_check_is_read_at_once_or_recorded_when_deferred() -> None:
    from gradzip.codecs.payload import PayloadError
    from gradzip.codecs.validation import deferred_checks, require

    require(torch.tensor(True), "fine", PayloadError)
    with pytest.raises(PayloadError, match="codes in range"):
        require(torch.tensor(False), "codes in range", PayloadError)
    with deferred_checks() as checks:
        require(torch.tensor(False), "codes in range", PayloadError)  # no raise
    assert bool(checks.failed(torch.device("cpu"))) and checks.describe() == "codes in range"
