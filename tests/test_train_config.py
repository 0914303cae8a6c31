"""Trainer configuration: presets, config files, CLI flags, documentation, validation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from train_helpers import flags

from gradzip.cli import build_parser, main
from gradzip.commands.train import resolve_args
from gradzip.train.config import SECTIONS, JobConfig, field_docs
from gradzip.train.configure import model_label, presets, resolve


def parse(*argv: str) -> JobConfig:
    return resolve_args(build_parser().parse_args(["train", *argv]))


def test_every_field_is_documented_and_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    for cls in SECTIONS.values():
        docs = field_docs(cls)
        for name in cls.__dataclass_fields__:
            assert docs.get(name), f"{cls.__name__}.{name} has no docstring"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--parallel", "--codec", "--max-steps", "--max-time", "--resume",
                 "--grad-accum", "--dtype", "--profile-steps", "--results-file", "--wandb",
                 "--model-vocab-size", "--dataset", "--keep-ckpts", "--target-loss"):
        assert flag in text


def test_presets_exist_and_apply() -> None:
    assert {"tiny", "small", "gpt2-124m", "llama-120m"} <= set(presets())
    gpt2 = parse("--model", "gpt2-124m")
    assert (gpt2.model.norm, gpt2.model.pos, gpt2.model.mlp) == ("layernorm", "learned", "gelu")
    assert gpt2.model.n_layer == 12 and gpt2.data.seq_len == 1024


def test_layers_defaults_preset_file_cli(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[model]\nname = "small"\n[optim]\nlr = 5e-4\nwarmup_steps = 7\n'
                 '[train]\nparallel = "ddp"\ncodec = "ef | topk(ratio=0.01)"\n')
    cfg = parse("--config", str(f), "--lr", "2e-4", "--no-tie-embeddings")
    assert cfg.model.name == "small" and cfg.model.dim == 256  # from the preset
    assert cfg.optim.warmup_steps == 7  # the file beats the preset
    assert cfg.optim.lr == 2e-4  # the command line beats the file
    assert cfg.model.tie_embeddings is False
    assert cfg.train.codec == "ef | topk(ratio=0.01)"
    # the resolved config, written as JSON, reads back to the same thing
    j = tmp_path / "config.json"
    j.write_text(json.dumps(cfg.to_dict()))
    assert resolve(base=json.loads(j.read_text())) == cfg


def test_a_resized_model_is_labelled_with_what_differs_from_its_preset() -> None:
    assert model_label(resolve({"model": {"name": "small"}}).model) == "small"
    # the tokenizer's vocabulary is not the architecture the label names
    assert model_label(resolve({"model": {"name": "small", "vocab_size": 512}}).model) == "small"
    resized = resolve({"model": {"name": "small", "dim": 320, "n_layer": 6, "n_head": 5}})
    assert model_label(resized.model) == "small+n_layer=6,n_head=5,dim=320"
    assert resized.model.name == "small"  # the preset it starts from is unchanged


def test_resume_starts_from_the_saved_config(tmp_path: Path) -> None:
    saved = resolve({"model": {"name": "small"}, "optim": {"lr": 1.5e-4, "decay_steps": 40},
                     "train": {"max_steps": 20}})
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    cfg = parse("--resume", "--out", str(tmp_path), "--max-steps", "40")
    assert cfg.optim.lr == 1.5e-4 and cfg.model.name == "small"
    assert cfg.train.max_steps == 40 and cfg.run.resume


@pytest.mark.parametrize("content,match", [
    ('[optim]\nlrr = 1.0\n', "unknown option optim.lrr"),
    ('[optimizer]\nlr = 1.0\n', "unknown section"),
    ('[optim]\nlr = "fast"\n', "optim.lr must be float"),
    ('[train]\ndiagnose = 1\n', "train.diagnose must be bool"),
    ('[optim\n', "cannot parse config file"),
])
def test_bad_config_files_are_clear_errors(tmp_path: Path, content: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        parse("--config", str(f))


@pytest.mark.parametrize("argv,match", [
    (["--parallel", "zero"], "--parallel must be one of"),
    (["--model", "gpt5"], "unknown model preset"),
    (["--seq-len", "1000"], "exceeds the model's --max-seq-len"),
    (["--dim", "30"], "divisible"),
    (["--profile-steps", "7-9"], "--profile-steps"),
    (["--comm-timeout", "0"], "--comm-timeout must be > 0"),
    (["--dtype", "fp16", "--device", "cpu"], "fp16 needs CUDA"),
])
def test_bad_values_are_clear_errors(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse(*argv)


def test_missing_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config file not found"):
        parse("--config", str(tmp_path / "nope.toml"))
    with pytest.raises(FileNotFoundError, match="cannot resume"):
        parse("--resume", "--out", str(tmp_path / "never-ran"))


def test_nonfinite_policy_lets_a_grad_scaler_see_inf_under_fp16() -> None:
    """fp16's GradScaler skips steps with Inf/NaN gradients: the codec must pass them on
    (propagate) rather than stop the step; elsewhere a NaN is an error naming the tensor."""
    from gradzip.train.checks import nonfinite_policy
    from gradzip.train.config import TrainConfig

    assert nonfinite_policy(TrainConfig(dtype="fp16")) == "propagate"
    assert nonfinite_policy(TrainConfig(dtype="bf16")) == "error"
    assert nonfinite_policy(TrainConfig(dtype="fp32", nonfinite="propagate")) == "propagate"
# ------------------------------------------------ resume: the lr schedule's end (issue 10)
def fake_run(out: Path, step: int | None, **sections: dict) -> Path:
    """A run directory as the loop leaves it: config.json and (maybe) a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(resolve(sections).to_dict()))
    if step is not None:
        ckpt = out / "checkpoints" / f"step_{step:07d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps(
            {"step": step, "world_size": 1, "format": "torch", "codec": "none"}))
    return out


def test_resume_refuses_to_move_the_schedule_end(tmp_path: Path) -> None:
    out = fake_run(tmp_path / "run", 10, train={"max_steps": 10},
                   optim={"lr": 1e-3, "warmup_steps": 10})
    with pytest.raises(ValueError) as e:
        parse("--resume", "--out", str(out), "--max-steps", "20")
    text = str(e.value)
    assert "from step 10 to step 20" in text
    assert "lr of step 11 would be 9.78e-04 instead of 1.00e-04" in text  # floor -> near peak
    assert "--decay-steps 10" in text and "--allow-schedule-change" in text
    # the advice works: keep the horizon (train on at the floor), or accept the jump
    kept = parse("--resume", "--out", str(out), "--max-steps", "20", "--decay-steps", "10")
    assert kept.schedule_horizon() == 10 and kept.train.max_steps == 20
    moved = parse("--resume", "--out", str(out), "--max-steps", "20", "--allow-schedule-change")
    assert moved.schedule_horizon() == 20
    # an unchanged horizon needs nothing; a smaller one is a move too
    assert parse("--resume", "--out", str(out)).schedule_horizon() == 10
    with pytest.raises(ValueError, match="from step 10 to step 5"):
        parse("--resume", "--out", str(out), "--decay-steps", "5")


def test_schedule_permission_is_not_inherited_from_the_saved_config(tmp_path: Path) -> None:
    out = fake_run(tmp_path / "run", 10, train={"max_steps": 10},
                   run={"allow_schedule_change": True})
    with pytest.raises(ValueError, match="--allow-schedule-change"):
        parse("--resume", "--out", str(out), "--max-steps", "20")


def test_pieces_of_one_schedule_resume_without_flags(tmp_path: Path) -> None:
    out = fake_run(tmp_path / "run", 10, train={"max_steps": 10}, optim={"decay_steps": 20})
    cfg = parse("--resume", "--out", str(out), "--max-steps", "20")
    assert cfg.schedule_horizon() == 20 and not cfg.run.allow_schedule_change


# ------------------------------------------------------------ absolute paths (issue 10)
def test_paths_are_stored_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("hello")
    (tmp_path / "tok").mkdir()
    argv = ["--dataset", "data/a.txt:2", "stdlib", "stdlib:1", "--cache-dir", "cache",
            "--out", "runs/x", "--tokenizer", "tok", "--results-file", "~/res.jsonl"]
    cfg = parse(*argv)
    assert cfg.data.sources == [f"{tmp_path}/data/a.txt:2", "stdlib", "stdlib:1"]
    assert cfg.data.cache_dir == str(tmp_path / "cache")
    assert cfg.data.tokenizer == str(tmp_path / "tok")
    assert cfg.run.out == str(tmp_path / "runs" / "x")
    assert cfg.run.results_file == str(Path("~/res.jsonl").expanduser().resolve())
    assert parse("--out", "x").data.tokenizer == ""  # unset stays unset
    resolved = cfg.to_dict()
    assert resolve(base=resolved).to_dict() == resolved  # idempotent (what --resume reads)
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert main(["train", *argv, "--print-config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["data"]["cache_dir"] == str(tmp_path / "cache")
    assert shown["data"]["sources"][0] == f"{tmp_path}/data/a.txt:2"


def test_resume_from_another_directory_keeps_the_paths(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    out = fake_run(Path("run"), 4, data={"sources": ["data"], "cache_dir": "cache"},
                   run={"out": "run"}, train={"max_steps": 4}, optim={"decay_steps": 8})
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    cfg = parse("--resume", "--out", str(tmp_path / "a" / out), "--max-steps", "8")
    assert cfg.data.sources == [str(tmp_path / "a" / "data")]
    assert cfg.data.cache_dir == str(tmp_path / "a" / "cache")


# ----------------------------------------------- every option checked before work (issue 10)
def no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.parametrize("argv,match", [
    (["--parallel", "fsdp", "--codec", "ef | powersgd(rank=2)"], "compresses gradient matrices"),
    (["--parallel", "fsdp", "--codec", "qsgd", "--codec-groups", "*.attn.qkv.weight=none"],
     "different codecs"),
    (["--codec", "qsgd"], "needs --parallel ddp or fsdp"),
    (["--parallel", "ddp", "--codec", "qsgd", "--codec-groups", "*norm*"], "PATTERNS=SPEC"),
    (["--parallel", "ddp", "--codec", "qsgd", "--codec-groups", "*norm*=bogus"], "bogus"),
    (["--parallel", "ddp", "--codec", "bogus"], "bogus"),
    (["--profile", "--profile-steps", "50:60", "--max-steps", "10"], "nothing would be profiled"),
    (["--vocab-size", "100"], "--vocab-size must be >= 257"),
    (["--beta2", "1.5"], "--beta2"),
    (["--seed", "-1"], "--seed"),
    (["--nonfinite", "ignore"], "--nonfinite"),
    (["--parallel", "fsdp", "--codec", "torch:powersgd(rank=2)"], "needs --parallel ddp"),
    (["--parallel", "ddp", "--codec", "torch:qsgd"], "unknown PyTorch hook"),
    (["--parallel", "ddp", "--codec", "torch:fp16", "--codec-start-step", "3"],
     "gradzip policies"),
    (["--ppl-budget-s", "-1"], "--ppl-budget-s"),
    (["--parallel", "fsdp", "--codec", "int8", "--hierarchical"], "--parallel hsdp"),
    (["--parallel", "ddp", "--codec", "torch:fp16", "--hierarchical"], "gradzip --codec"),
    (["--threads", "-2"], "--threads"),
    (["--dataset", "stdlib:-1"], "weight must be a positive number"),
    (["--dataset", "missing.txt"], "data source not found"),
    (["--tokenizer", "missing.json"], "tokenizer not found"),
    (["--wandb"], "pip install wandb"),
    pytest.param(["--dtype", "fp16"], "fp16 needs CUDA",
                 marks=pytest.mark.skipif(not no_cuda(), reason="CUDA present")),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(not no_cuda(), reason="CUDA present")),
])
@pytest.mark.parametrize("print_config", [False, True])
def test_bad_options_fail_before_any_file_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], match: str, print_config: bool) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes ``import wandb`` fail
    monkeypatch.chdir(tmp_path)  # relative paths (missing.txt) land here, if anywhere
    argv = flags(tmp_path / "cache", tmp_path / "out", "--max-steps", "2", *argv)
    assert main(["train", *argv, *(["--print-config"] if print_config else [])]) == 2
    assert match in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run directory, no data cache


@pytest.mark.parametrize("meta,argv,match", [
    (None, [], "has no checkpoint"),
    ({"step": 8}, [], "raise --max-steps"),
    ({"codec": "qsgd"}, [], "was written with codec 'qsgd'"),
    ({"world_size": 2}, [], "written by 2 ranks"),
    ({}, ["--parallel", "fsdp"], "resumes only from an FSDP (DCP) checkpoint"),
])
def test_unusable_resumes_fail_before_any_work(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               meta: dict | None, argv: list[str],
                                               match: str) -> None:
    out = fake_run(tmp_path / "run", None, train={"max_steps": 8})
    if meta is not None:
        ckpt = out / "checkpoints" / "step_0000002"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps(
            {"step": 2, "world_size": 1, "format": "torch", "codec": "none", **meta}))
    before = sorted(tmp_path.rglob("*"))
    assert main(["train", "--resume", "--out", str(out), *argv]) == 2
    assert match in capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before


def test_a_fresh_run_into_a_run_with_checkpoints_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = fake_run(tmp_path / "run", 2, train={"max_steps": 8})
    assert main(["train", "--out", str(out), "--print-config"]) == 2
    assert "pass --resume" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--outer", "diloco", "--sync-every", "0", "--parallel", "ddp"], "sync_every"),
    (["--outer", "diloco"], "--parallel ddp"),
    (["--outer", "diloco", "--parallel", "fsdp"], "FSDP2 is not supported"),
    (["--outer", "diloco", "--parallel", "ddp", "--codec", "int8"], "--outer-codec"),
    (["--outer", "diloco", "--parallel", "ddp", "--outer-codec", "topk(ratio=7)"], "ratio"),
    (["--outer", "streaming", "--parallel", "ddp"], "outer must be one of"),
    (["--outer", "diloco", "--parallel", "ddp", "--sync-every", "2", "--fragments", "4"],
     "fragments must be in"),
    (["--outer", "diloco", "--parallel", "ddp", "--n-layer", "4", "--fragments", "3"],
     "does not divide the model's 4 blocks"),
    (["--outer", "diloco", "--parallel", "ddp", "--sync-every", "4", "--overlap-steps", "4"],
     "overlap_steps must be in"),
    (["--optimizer", "lion"], "--optimizer"),
    (["--parallel", "ddp", "--codec", "demo"], "--optimizer sgd --grad-clip 0"),
    (["--parallel", "ddp", "--codec", "demo", "--optimizer", "sgd"], "--grad-clip 0"),
])
def test_bad_outer_options_fail_before_training(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_args(build_parser().parse_args(["train", *argv])).validate()


def test_demo_with_plain_sgd_is_accepted() -> None:
    argv = ["train", "--parallel", "ddp", "--codec", "demo(topk=8)", "--optimizer", "sgd",
            "--grad-clip", "0"]
    resolve_args(build_parser().parse_args(argv)).validate()


def test_a_file_as_outs_parent_is_refused_before_any_work(tmp_path: Path) -> None:
    """A file as --out's parent, or a read-only directory: one clear error before any
    work (data preparation), not a traceback later."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    from gradzip.commands.train import check_environment

    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_environment(parse("--out", str(blocker / "run")))


def test_a_read_only_out_is_refused_before_any_work(tmp_path: Path) -> None:
    from gradzip.commands.train import check_environment

    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os
        if os.access(locked, os.W_OK):  # root ignores the mode bits: nothing to test
            pytest.skip("running as root: a read-only directory is still writable")
        with pytest.raises(ValueError, match="cannot write under"):
            check_environment(parse("--out", str(locked / "run")))
    finally:
        locked.chmod(0o700)
