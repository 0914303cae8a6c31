"""Trainer configuration: presets, config files, CLI flags, documentation, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradzip.cli import build_parser
from gradzip.commands.train import resolve_args
from gradzip.train.config import SECTIONS, JobConfig, field_docs, presets, resolve


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
                 '[train]\ncodec = "ef | topk(ratio=0.01)"\n')
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


def test_resume_starts_from_the_saved_config(tmp_path: Path) -> None:
    saved = resolve({"model": {"name": "small"}, "optim": {"lr": 1.5e-4}})
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
    from gradzip.train.config import TrainConfig, nonfinite_policy

    assert nonfinite_policy(TrainConfig(dtype="fp16")) == "propagate"
    assert nonfinite_policy(TrainConfig(dtype="bf16")) == "error"
    assert nonfinite_policy(TrainConfig(dtype="fp32", nonfinite="propagate")) == "propagate"
    cfg = JobConfig()
    cfg.train.nonfinite = "ignore"
    with pytest.raises(ValueError, match="--nonfinite"):
        cfg.validate()
