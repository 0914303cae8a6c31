"""Single-process tests of the comm package: stats arithmetic, index bytes, ops, spec errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip.codecs.payload import Payload
from gradzip.comm.fsdp import scaling
from gradzip.comm.reducer import index_bytes
from gradzip.comm.stats import CommStats, Reduction, union_length


def test_bad_spec_fails_at_attach_before_anything_else():
    with pytest.raises(gradzip.SpecError):
        gradzip.attach(nn.Linear(2, 2), "topk(ratio=2.0) | nosuchcodec")
    with pytest.raises(gradzip.SpecError):
        gradzip.ddp_hook("ef | ef")


def test_stats_per_step_and_totals():
    s = CommStats()
    assert s.summary()["bytes_wire"] == 0 and s.summary()["compression_ratio"] is None
    s.record(Reduction(numel=100, sent_values=10, bytes_raw=400, index_bytes=20, encode_s=0.001,
                       bytes_by_op={"all_gather": 8 + 60}, calls_by_op={"all_gather": 2},
                       seconds_by_op={"all_gather": 0.002}))
    s.record_residual("b0", 3.0)
    s.record_residual("b1", 4.0)
    s.end_step()
    one = s.summary()
    assert one["bytes_raw"] == 400 and one["bytes_wire"] == 68
    assert one["compression_ratio"] == pytest.approx(400 / 68)
    assert one["density"] == pytest.approx(0.1) and one["index_bytes"] == 20
    assert one["extra_collectives"] == 1 and one["residual_norm"] == pytest.approx(5.0)
    assert one["comm_ms_by_op"] == {"all_gather": pytest.approx(2.0)}
    assert one["grad_rel_error"] is None
    s.record(Reduction(numel=100, sent_values=100, bytes_raw=400,
                       bytes_by_op={"all_reduce": 400}, calls_by_op={"all_reduce": 1}))
    s.record_diagnostic(err_sq=1.0, ref_sq=4.0, est_sq=4.0, dot=3.5, nbytes=400)
    s.end_step()
    two = s.summary()
    assert two["bytes_wire"] == 400 and two["grad_rel_error"] == pytest.approx(0.5)
    assert two["grad_cos_sim"] == pytest.approx(3.5 / 4.0) and two["bytes_diagnostic"] == 400
    tot = s.totals()
    assert tot["steps"] == 2 and tot["bytes_wire"] == 468 and tot["bytes_raw"] == 800
    assert tot["density"] == pytest.approx(110 / 200)


def test_comm_time_is_the_union_of_overlapping_async_reductions():
    """Two asynchronous buckets in flight at once count their overlap once; reductions
    on the communication thread (no span) add up; extra rounds are reported apart."""
    s = CommStats()
    s.record(Reduction(numel=1, sent_values=1, bytes_raw=4, span=(10.0, 10.004),
                       seconds_by_op={"all_reduce": 0.004}))
    s.record(Reduction(numel=1, sent_values=1, bytes_raw=4, span=(10.002, 10.005),
                       seconds_by_op={"all_reduce": 0.003}))
    s.record(Reduction(numel=1, sent_values=1, bytes_raw=4, extra_collective_s=0.001,
                       seconds_by_op={"all_reduce": 0.002, "all_gather": 0.001}))
    s.end_step()
    one = s.summary()
    assert one["comm_ms"] == pytest.approx(5.0 + 3.0)  # union 10.000-10.005, then 3 ms
    assert one["comm_ms_by_op"] == {"all_gather": pytest.approx(1.0),
                                    "all_reduce": pytest.approx(9.0)}
    assert one["extra_collective_ms"] == pytest.approx(1.0)
    s.record(Reduction(numel=1, sent_values=1, bytes_raw=4, span=(20.0, 20.001)))
    s.end_step()
    assert s.totals()["comm_ms"] == pytest.approx(9.0)
    assert union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)


def test_index_bytes_counts_index_fields_at_any_depth():
    p = Payload({"values": torch.zeros(4), "indices": torch.zeros(4, dtype=torch.int32),
                 "coded": Payload({"gap_index": b"abc", "x": torch.zeros(2, dtype=torch.int8)})})
    assert index_bytes(p) == 16 + 3


def test_index_bytes_of_real_sparse_payloads():
    # topk sends its positions as ``deltas`` or a ``bitmap``; an entropy coder may re-code them
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for spec, form in (("topk(ratio=0.01)", "deltas"), ("topk(ratio=0.5)", "bitmap")):
        p = gradzip.codec(spec).encode(x)
        assert index_bytes(p) == p.fields[form].numel() * p.fields[form].element_size(), spec
    coded = gradzip.codec("topk(ratio=0.01) | eg").encode(x)
    assert isinstance(coded.fields["deltas"], Payload)
    assert 0 < index_bytes(coded) < coded.wire_bytes


def test_scaling_follows_fsdp_ops():
    assert scaling(dist.ReduceOp.AVG, 4) == (4.0, 1.0)
    assert scaling(dist.ReduceOp.SUM, 4) == (1.0, 1.0)
    assert scaling(dist.ReduceOp.PREMUL_SUM(0.25), 4) == (1.0, 0.25)
    with pytest.raises(ValueError, match="AVG, SUM and PREMUL_SUM"):
        scaling(dist.ReduceOp.MAX, 4)


def test_import_gradzip_stays_free_of_torch_distributed_comm():
    import subprocess
    import sys

    code = "import sys, gradzip; assert 'gradzip.comm' not in sys.modules; gradzip.attach"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hsdp_state_and_specs_are_checked() -> None:
    """A checkpoint with (or without) an HSDP replicate link does not load into a handle
    without (or with) one; a per-dimension spec names its links, anything else is the
    replicate link's; a shard layout that no longer tiles the output is dropped."""
    import torch

    from gradzip.codecs.chain import Codec
    from gradzip.comm.attach import Handle
    from gradzip.comm.fsdp import layout_or_none
    from gradzip.comm.hsdp import split_spec
    from gradzip.comm.policy import Policy
    from gradzip.comm.stats import CommStats

    plain = Handle("fsdp2", [Codec.from_spec("none")], CommStats(), Policy.parse("none"))
    hsdp = Handle("fsdp2", [Codec.from_spec("none")], CommStats(), Policy.parse("none"))
    hsdp.replicate_codecs = [Codec.from_spec("ef | topk(ratio=0.1)")]
    with pytest.raises(ValueError, match="with an HSDP replicate link"):
        plain.load_state_dict(hsdp.state_dict())
    with pytest.raises(ValueError, match="without an HSDP replicate link"):
        hsdp.load_state_dict(plain.state_dict())
    hsdp.load_state_dict(hsdp.state_dict())
    assert split_spec({"replicate": "int8"}) == ("int8", "none")
    assert split_spec({"codec": "int8"}) == ({"codec": "int8"}, "none")  # a policy
    shapes = [torch.Size((2, 3)), torch.Size((4,))]
    assert layout_or_none(shapes, 10) == shapes and layout_or_none(shapes, 6) is None


def test_bits_per_kept_value_count_only_reductions_that_sent_a_payload() -> None:
    from gradzip.comm.stats import CommStats, Reduction

    stats = CommStats()
    stats.record(Reduction(numel=1000, sent_values=1000, bytes_raw=4000,
                           paths=["plain"]))  # DDP's first step
    stats.end_step()
    for _ in range(3):
        stats.record(Reduction(numel=1000, sent_values=10, bytes_raw=4000, index_bytes=40,
                               payload_bytes=85, paths=["gather"]))
        stats.end_step()
    assert stats.totals()["bits_per_kept_value"] == {"indices": 32.0, "values": 36.0}
    assert stats.summary()["bits_per_kept_value"] == {"indices": 32.0, "values": 36.0}
    assert stats.steady_bytes()["bytes_raw"] == 3 * 4000
