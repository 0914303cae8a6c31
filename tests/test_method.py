"""``Method``: one grammar for how gradients cross the link, parsed once where text enters.

The units check the grammar (every kind, its canonical text, its JSON, the ``gradzip
train`` flags it maps to, the errors); the last test counts, from outside the code
(a profile hook in ``sitecustomize``), how often a 2-rank DDP ``gradzip train`` parses
a codec spec on each rank.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
from train_helpers import flags, last_result, launch

from gradzip.codecs import Codec, SpecError
from gradzip.comm.method import (
    CodecMethod,
    LocalUpdateMethod,
    SnooMethod,
    TorchHookMethod,
    every_codec,
    parse_method,
)


def test_each_kind_parses_to_its_type_and_back_to_its_text() -> None:
    codec = parse_method("ef | topk(ratio=0.01)")
    assert isinstance(codec, CodecMethod) and str(codec) == "ef | topk(ratio=0.01)"
    assert codec.to_json() == Codec.from_spec("ef | topk(ratio=0.01)").to_json()
    assert parse_method("none").plain and parse_method("none").to_json() is None
    # a policy naming `none` still goes through gradzip's hook (FSDP2 attaches it)
    assert not parse_method('{"codec": "none"}').plain

    hook = parse_method(" torch:powersgd(rank=4) ")
    assert isinstance(hook, TorchHookMethod) and str(hook) == "torch:powersgd(rank=4)"
    assert hook.to_json() == {"torch_hook": "powerSGD_hook", "rank": 4, "start_iter": 2}

    local = parse_method("diloco(sync_every=16, lr=0.5) | int8")
    assert isinstance(local, LocalUpdateMethod)
    assert (local.sync_every, local.lr, local.momentum) == (16, 0.5, 0.9)
    assert str(local) == "diloco(sync_every=16, lr=0.5, momentum=0.9) | int8"
    assert str(parse_method(str(local))) == str(local)  # the canonical text parses back
    assert parse_method("average(sync_every=8)").codec is None


def test_a_policy_with_groups_keeps_every_codec_built_once() -> None:
    method = parse_method("qsgd", groups={"*.bias,*norm*": "none"}, start_step=3)
    assert isinstance(method, CodecMethod)
    assert [str(c) for c in method.codecs] == ["qsgd", "none"]
    assert method.policy.start_step == 3 and not method.plain
    assert method.to_json() == {"codec": "qsgd", "start_step": 3,
                                "groups": [{"params": ["*.bias", "*norm*"], "codec": "none"}]}
    # the prototypes are copied, never parsed again, and the copies share no state
    a, b = (c.fresh(rank=r) for r, c in enumerate(method.codecs[:1] * 2))
    assert str(a) == str(b) == "qsgd" and a.state is not b.state


@pytest.mark.parametrize("text, error, match", [
    ("ef | bogus", SpecError, "bogus"),
    ("diloco(H=3)", ValueError, "takes sync_every="),
    ("diloco(sync_every=x)", ValueError, "sync_every must be a number"),
    ("diloco(sync_every=0)", ValueError, "sync_every"),
    ("average(sync_every=4) | topk(ratio=7)", SpecError, "ratio"),
    ("torch:qsgd", ValueError, "unknown PyTorch hook"),
    ("sparseloco(k=8, density=0.01)", ValueError, "k \\(per chunk\\) or density"),
    ("sparseloco(k=8) | int8", ValueError, "options \\(k\\) or an explicit codec"),
    ("sparseloco(bits=9)", SpecError, "bits"),
    ("snoo(fragments=2)", ValueError, "snoo\\(...\\) takes sync_every=, lr=, momentum="),
    ("diloco(k=8)", ValueError, "takes sync_every="),
    ("diloco(alpha=1)", ValueError, "alpha"),
])
def test_a_bad_method_says_what_is_wrong(text: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_method(text)


def test_sparseloco_is_diloco_with_its_outer_step_and_codec_spelled_out() -> None:
    m = parse_method("sparseloco")
    assert isinstance(m, LocalUpdateMethod) and m.outer == "sparseloco"
    assert (m.sync_every, m.lr, m.momentum) == (30, 1.0, 0.0)  # the paper's H, outer lr
    assert str(m.codec) == ("ef(beta=0.95) | topk(k=64, chunk=4096) | centroid(bits=2) | ans "
                            "| aggregate=gather")
    assert parse_method(str(m)) == m  # the canonical text is the explicit form
    dense = parse_method("sparseloco(sync_every=15, density=0.02, bits=3, ef_decay=0.9)")
    assert str(dense.codec).startswith("ef(beta=0.9) | topk(ratio=0.02, chunk=4096) | "
                                       "centroid(bits=3)")
    assert dense.sync_every == 15
    # templar's value quantizer, an option: bins over 6 std, a table of bin means
    templar = parse_method("sparseloco(values=stdbins)")
    assert "| stdbins(bins=4) | ans" in str(templar.codec)
    with pytest.raises(ValueError, match="values must be one of centroid, stdbins"):
        parse_method("sparseloco(values=uniform)")
    # at many replicas an all-gather sends (W-1) payloads; two phases send about two
    two = parse_method("sparseloco(aggregate=two_phase)")
    assert str(two.codec).endswith("| ans | aggregate=two_phase")
    with pytest.raises(ValueError, match="aggregate must be one of gather, two_phase, auto"):
        parse_method("sparseloco(aggregate=tree)")
    # one rotating rank's positions for all, the values summed: bytes independent of W
    shared = parse_method("sparseloco(aggregate=shared, k=32)")
    assert str(shared.codec) == ("ef(beta=0.95) | sharedtopk(k=32, chunk=4096, values=fp16, "
                                 "select=each)")
    dense_shared = parse_method("sparseloco(aggregate=shared, density=0.01, chunk=2048, "
                                "bits=8)")
    assert str(dense_shared.codec) == ("ef(beta=0.95) | sharedtopk(k=20, chunk=2048, "
                                       "values=int8, select=each)")
    leader = parse_method("sparseloco(aggregate=shared, select=leader)")
    assert str(leader.codec).endswith("select=leader)")
    with pytest.raises(ValueError, match="select= picks the positions of aggregate=shared"):
        parse_method("sparseloco(select=each)")
    with pytest.raises(ValueError, match="select must be one of leader, each"):
        parse_method("sparseloco(aggregate=shared, select=all)")
    with pytest.raises(ValueError, match="tile=, values= describe a gathered payload"):
        parse_method("sparseloco(aggregate=shared, tile=64, values=stdbins)")
    with pytest.raises(ValueError, match="bits must be one of 16, 8, got 3"):
        parse_method("sparseloco(aggregate=shared, bits=3)")


def test_fragments_may_each_have_their_own_codec() -> None:
    m = parse_method("diloco(sync_every=8, fragments=2) | int8 / centroid(bits=4)")
    assert isinstance(m, LocalUpdateMethod)
    assert [str(c) for c in m.per_fragment] == ["int8", "centroid(bits=4)"]
    assert str(m) == ("diloco(sync_every=8, lr=0.7, momentum=0.9, fragments=2) | int8 / "
                      "centroid(bits=4)")
    assert [str(c) for c in m.options()["codec"]] == ["int8", "centroid(bits=4)"]
    assert [str(c) for c in m.codecs] == ["int8", "centroid(bits=4)"]
    assert m.to_json()["codec"][1] == Codec.from_spec("centroid(bits=4)").to_json()
    with pytest.raises(ValueError, match="3 codecs separated by ' / ' for 2 fragment"):
        parse_method("diloco(fragments=2) | int8 / fp16 / none")


def test_snoo_is_ddp_with_an_outer_step() -> None:
    m = parse_method("snoo(sync_every=16) | fp16")
    assert isinstance(m, SnooMethod)
    assert str(m) == "snoo(sync_every=16, lr=0.7, momentum=0.9) | fp16"
    assert str(parse_method("snoo").step_method) == "none"
    assert m.to_json()["codec"] == Codec.from_spec("fp16").to_json()
    with pytest.raises(ValueError, match="--parallel ddp"):
        m.check(parallel="fsdp", optimizer="adamw", grad_clip=1.0)


@pytest.mark.parametrize("text", [
    "sparseloco", "sparseloco(sync_every=10, density=0.05, ef_decay=0.9)",
    "sparseloco(values=stdbins)", "sparseloco(aggregate=two_phase)",
    "sparseloco(aggregate=shared)", "sparseloco(aggregate=shared, bits=8, select=each)",
    "snoo(sync_every=8, lr=0.5, momentum=0.5)", "snoo | int8",
    "diloco(sync_every=8, overlap=2, alpha=0.5) | centroid(bits=4)",
    "diloco(sync_every=8, fragments=2) | int8 / none",
])
def test_train_flags_run_the_method_they_came_from(text: str) -> None:
    """compare runs a method through ``gradzip train``'s flags: parsed back from them
    (with the trainer's defaults for the rest) it is the same method."""
    from gradzip.cli import build_parser
    from gradzip.commands.train import resolve_args
    from gradzip.train.checks import method_of

    method = parse_method(text)
    args = build_parser().parse_args(["train", "--parallel", "ddp", *method.train_flags()])
    assert method_of(resolve_args(args).train) == method


def test_policy_options_belong_to_codec_methods_only() -> None:
    with pytest.raises(ValueError, match="gradzip policies; torch:fp16 takes its own"):
        parse_method("torch:fp16", start_step=3)
    with pytest.raises(ValueError, match="gradzip policies"):
        parse_method("diloco(sync_every=4)", groups={"*.bias": "none"})


def test_checks_take_plain_values_and_each_rule_is_written_once() -> None:
    with pytest.raises(ValueError, match="needs --parallel ddp or fsdp"):
        parse_method("qsgd").check(parallel="none", optimizer="adamw", grad_clip=1.0)
    # nothing to send, nothing to refuse
    parse_method("none").check(parallel="none", optimizer="adamw", grad_clip=1.0)
    with pytest.raises(ValueError, match="--optimizer sgd --grad-clip 0"):
        parse_method("demo").check(parallel="ddp", optimizer="adamw", grad_clip=1.0)
    parse_method("demo").check(parallel="ddp", optimizer="sgd", grad_clip=0.0)
    with pytest.raises(ValueError, match="needs --parallel ddp"):
        parse_method("torch:fp16").check(parallel="fsdp", optimizer="adamw", grad_clip=1.0)
    with pytest.raises(ValueError, match="does not divide the model's 4 blocks"):
        parse_method("diloco(sync_every=8, fragments=3)").check(
            parallel="ddp", optimizer="adamw", grad_clip=1.0, blocks=4)
    units = {"": ["emb.weight"], "blocks.0": ["blocks.0.attn.weight", "blocks.0.norm.w"]}
    with pytest.raises(SpecError, match="different codecs"):
        parse_method("qsgd", groups={"*norm*": "none"}).check(
            parallel="fsdp", optimizer="adamw", grad_clip=1.0, fsdp_units=units)


def test_demo_runs_with_the_plain_step_it_needs() -> None:
    assert parse_method("demo(topk=8)").train_flags() == [
        "--codec", "demo(topk=8)", "--optimizer", "sgd", "--grad-clip", "0"]


def test_local_update_defaults_are_the_trainers() -> None:
    """A compare method that leaves an option out runs with the value ``gradzip train``
    would use, so a record's method name and its run agree."""
    from gradzip.train.checks import method_of
    from gradzip.train.config import TrainConfig

    t = TrainConfig(outer="diloco", parallel="ddp")
    assert method_of(t) == LocalUpdateMethod()
    assert dataclasses.asdict(method_of(dataclasses.replace(t, outer="average"))) == \
        dataclasses.asdict(LocalUpdateMethod(outer="average"))


def test_every_codec_lists_the_codecs_a_run_compiles() -> None:
    methods = [parse_method("qsgd | eg", groups={"*norm*": "int8"}),
               parse_method("torch:fp16"), parse_method("diloco(sync_every=4) | int8 | ans")]
    assert [str(c) for c in every_codec(methods)] == ["qsgd | eg", "int8", "int8 | ans"]


COUNTER = '''
import os, sys, threading
_OUT = os.environ["GRADZIP_COUNT_PARSES"]
_FILE = os.path.join("gradzip", "codecs", "spec.py")

def _count(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "parse_options" \\
            and frame.f_code.co_filename.endswith(_FILE):
        with open(os.path.join(_OUT, str(os.getpid())), "a") as f:
            f.write("parse\\n")

sys.setprofile(_count)
threading.setprofile(_count)
'''


@pytest.mark.dist
def test_a_ddp_run_parses_its_spec_at_most_twice_per_rank(cache: Path,
                                                          tmp_path: Path) -> None:
    """Counted from outside: a ``sitecustomize`` profile hook writes a line per call of
    the spec grammar's entry (``codecs.spec.parse_options``) per process. Once when the
    flags are validated, once when the trainer builds its method; warming the kernels,
    every rank's codec, the group codecs and the record reuse those (``Codec.fresh``)."""
    hook_dir, counts = tmp_path / "hook", tmp_path / "counts"
    hook_dir.mkdir()
    counts.mkdir()
    (hook_dir / "sitecustomize.py").write_text(COUNTER)
    env = {**os.environ, "GRADZIP_COUNT_PARSES": str(counts),
           "PYTHONPATH": os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run"
    argv = [*launch(2), "-m", "gradzip", "train",
            *flags(cache, out, "--parallel", "ddp", "--codec", "ef | topk(ratio=0.1) | eg",
                   "--max-steps", "3")]
    subprocess.run(argv, check=True, env=env, timeout=300, capture_output=True)
    per_process = [len(f.read_text().splitlines()) for f in sorted(counts.iterdir())]
    assert len(per_process) == 2, per_process  # the two ranks (torchrun parses nothing)
    assert all(1 <= n <= 2 for n in per_process), per_process
    record = last_result(out)
    assert record["method"] == "ef | topk(ratio=0.1) | eg"
    assert record["codec_config"] == Codec.from_spec("ef | topk(ratio=0.1) | eg").to_json()


@pytest.mark.parametrize("changes, match", [
    ({"outer": "snoo", "outer_codec": "int8"}, "its outer step sends nothing"),
    ({"outer": "snoo", "fragments": 2}, "--fragments"),
    ({"outer": "snoo", "codec": "torch:fp16"}, "takes a gradzip --codec"),
])
def test_snoo_flags_refuse_what_does_not_apply(changes: dict, match: str) -> None:
    from gradzip.train.checks import method_of
    from gradzip.train.config import TrainConfig

    with pytest.raises(ValueError, match=match):
        method_of(dataclasses.replace(TrainConfig(parallel="ddp"), **changes))


def test_an_unknown_outer_kind_names_the_choices() -> None:
    from gradzip.cli import build_parser
    from gradzip.commands.train import resolve_args

    args = build_parser().parse_args(["train", "--parallel", "ddp", "--outer", "demo"])
    with pytest.raises(ValueError, match="--outer must be one of none, diloco, average, "
                                         "sparseloco, snoo"):
        resolve_args(args).validate()
