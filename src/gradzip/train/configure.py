"""How a run's configuration is resolved, in layers, later ones winning:

1. the dataclass defaults of ``config.py`` (every default has a comment saying why);
2. the model preset ``presets/<model>.json`` (it may also set data and optimizer fields);
3. a config file (``--config run.toml`` or ``.json``, the same sections);
4. command-line flags, e.g. ``--model small --lr 3e-4``.

With ``--resume`` the saved ``config.json`` of the run replaces layers 1-2, so a resumed
run keeps its settings unless a flag says otherwise (typically ``--max-steps``).
The resolved configuration is written to ``<out>/config.json``, which is itself a
valid config file; its paths are absolute, so it means the same files from any directory.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from gradzip.train.config import SECTIONS, JobConfig, ModelConfig, fields_of

PRESET_DIR = Path(__file__).parent / "presets"


def _coerce(section: str, name: str, value: Any, typ: Any, int_ok: bool = False) -> Any:
    """Check a value from a file against the field type (ints may stand for floats, and
    for the text of a field that was once an int: ``int_ok``)."""
    where = f"{section}.{name}"
    if int_ok and typ is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if typing.get_origin(typ) is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where} must be a list of strings, got {value!r}")
        return list(value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (typ is bool) or not isinstance(value, typ):
        raise ValueError(f"{where} must be {typ.__name__}, got {value!r}")
    return value


def apply_overrides(cfg: JobConfig, overrides: dict[str, Any], origin: str) -> None:
    """Set ``{section: {field: value}}`` on cfg, with clear errors for unknown names."""
    for section, values in overrides.items():
        if section.startswith("_"):  # "_doc" and other comments in preset files
            continue
        if section not in SECTIONS:
            raise ValueError(f"{origin}: unknown section {section!r}; "
                             f"expected one of {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: section {section!r} must be a table/object")
        target = getattr(cfg, section)
        known = {f.name: t for f, t in fields_of(SECTIONS[section])}
        int_ok = {f.name for f, _ in fields_of(SECTIONS[section]) if f.metadata.get("int_ok")}
        for name, value in values.items():
            if name not in known:
                raise ValueError(f"{origin}: unknown option {section}.{name}; "
                                 f"known: {', '.join(known)}")
            setattr(target, name, _coerce(section, name, value, known[name],
                                          name in int_ok))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A .toml or .json config file as ``{section: {field: value}}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        if path.suffix == ".toml":
            return tomllib.loads(path.read_text())
        if path.suffix == ".json":
            return json.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse config file {path}: {e}") from None
    raise ValueError(f"config file must end in .toml or .json: {path}")


def model_label(model: ModelConfig) -> str:
    """The model's name for records and logs: its preset, plus every architecture field
    set away from that preset (``small+n_layer=6,n_head=5,dim=320``), so that a resized
    model never reads as the preset it started from. ``vocab_size`` follows the
    tokenizer and is left out."""
    try:
        preset = read_preset(model.name)
    except ValueError:  # a saved config from a preset this version does not ship
        return model.name
    reference = JobConfig()
    apply_overrides(reference, {"model": preset.get("model", {})},
                    origin=f"preset {model.name}")
    changed = [f"{f.name}={getattr(model, f.name)}" for f in dataclasses.fields(model)
               if f.name not in ("name", "vocab_size")
               and getattr(model, f.name) != getattr(reference.model, f.name)]
    return "+".join([model.name, ",".join(changed)]) if changed else model.name


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def read_preset(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(presets())}")
    return json.loads(path.read_text())


def resolve(
    cli: dict[str, dict[str, Any]] | None = None,
    config_file: str | Path | None = None,
    base: dict[str, Any] | None = None,
) -> JobConfig:
    """Build the run's configuration: defaults or ``base``, preset, file, then CLI.

    ``base`` is a saved, already resolved configuration (resume): it stands in for the
    defaults and the preset, so the model preset is not re-applied over it. Paths come
    out absolute (``JobConfig.resolve_paths``) and every value is checked (``validate``).
    """
    cli = cli or {}
    from_file = read_config_file(config_file) if config_file else {}
    cfg = JobConfig()
    if base is not None:
        apply_overrides(cfg, base, origin="saved config")
    else:
        name = (cli.get("model", {}).get("name") or from_file.get("model", {}).get("name")
                or cfg.model.name)
        apply_overrides(cfg, read_preset(name), origin=f"preset {name}")
        cfg.model.name = name
    apply_overrides(cfg, from_file, origin=str(config_file))
    apply_overrides(cfg, cli, origin="command line")
    cfg.resolve_paths()
    cfg.validate()
    return cfg
