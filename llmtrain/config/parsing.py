"""A config's text as checked values: the packaged presets and TOML files, the dotted
overrides of a command line (``--optim.lr 3e-4``), each value coerced to its field's
type and checked against the field's allowed values, and step ranges
(``'120-130,400'``). An unknown key, a wrong type or an out-of-range value raises
:class:`llmtrain.config.sections.ConfigError` naming the field, the value and what is
allowed."""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from llmtrain.config.sections import ConfigError


def step_ranges(field_name: str, text: str) -> set[int]:
    """``'120-130,400'`` as the set of steps it names, or ConfigError naming the field."""
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or int(last or first) < int(first):
            raise ConfigError(f"{field_name}={text!r}: {part!r} is not a step N or a range "
                              f"A-B with A <= B; e.g. '120-130,400'")
        steps.update(range(int(first), int(last or first) + 1))
    return steps


def preset_names() -> list[str]:
    """The packaged presets' names (``llmtrain/configs/*.toml``)."""
    return sorted(p.name.removesuffix(".toml")
                  for p in resources.files("llmtrain.configs").iterdir()
                  if p.name.endswith(".toml"))


def read_preset(preset: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The TOML tables of ``preset``: a packaged preset's name or a TOML file's path. A
    file whose top level says ``preset = "NAME"`` (a packaged preset, or another TOML file,
    relative to this one) starts from that preset's tables, its own fields on top; without
    it, a file starts from the dataclasses' defaults."""
    path = Path(preset)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {preset!r} does not exist")
        text, me = path.read_text(), str(path.resolve())
    else:
        res = resources.files("llmtrain.configs").joinpath(f"{preset}.toml")
        if not res.is_file():
            raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(preset_names())}"
                              f" (or give the path of a .toml file)")
        text, me = res.read_text(), preset
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {preset!r} is not valid TOML: {e}") from None
    base = tables.pop("preset", None)
    if base is None:
        return tables
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config {preset!r}: preset = {base!r} must name a preset "
                          f"({', '.join(preset_names())}) or a .toml file")
    if base.endswith(".toml") and not Path(base).is_absolute():
        base = str(path.parent / base)
    if me in _seen:
        raise ConfigError(f"config {preset!r}: its presets go round in a circle "
                          f"({' -> '.join(_seen + (me,))})")
    merged = read_preset(base, _seen + (me,))
    for section, table in tables.items():
        if isinstance(table, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **table}
        else:
            merged[section] = table
    return merged


# Keys that moved to another section: a config written before says where they are now.
_MOVED = {"checkpoint.save_on_signal": "control.save_on_signal",
          "checkpoint.vote_interval_s": "control.vote_interval_s"}


def unknown_key(key: str, valid: list[str]) -> ConfigError:
    """The error for a key no section has, naming the one meant, or where it moved."""
    if key in _MOVED:
        return ConfigError(f"config key {key!r} moved to {_MOVED[key]!r} (the run control "
                           f"decides signals and stops, with checkpoints on or off): rename it")
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}")


def coerce(name: str, ftype: str, value: Any) -> Any:
    """``value`` (from TOML or a command-line string) as the field's type."""
    from_cli = isinstance(value, str) and ftype != "str"
    try:
        if ftype == "bool":
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in ("true", "1", "yes", "on"):
                return True
            if from_cli and value.lower() in ("false", "0", "no", "off"):
                return False
        elif ftype == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if from_cli:
                return int(value)
        elif ftype == "float":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if from_cli:
                out = float(value)
                if math.isfinite(out):
                    return out
        elif ftype == "str" and isinstance(value, str):
            return value
    except ValueError:
        pass
    kind = {"bool": "true or false", "int": "an integer", "float": "a finite number",
            "str": "a string"}[ftype]
    raise ConfigError(f"config field {name!r} expects {kind}, got {value!r}")


def check_field(name: str, f: dataclasses.Field, value: Any) -> None:
    """ConfigError unless ``value`` is among the field's choices and within its bounds."""
    md = f.metadata
    if md.get("choices") and value not in md["choices"]:
        raise ConfigError(f"config field {name!r} = {value!r} is not allowed; "
                          f"choose one of: {', '.join(map(repr, md['choices']))}")
    for op, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                         ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = md.get(op)
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"config field {name!r} = {value!r} is out of range: "
                              f"it must be {word} {bound}")


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``['--optim.lr', '3e-4', '--training.steps=5']`` as ``[(key, value), ...]``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"expected an override like --section.field VALUE, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg!r} has no value")
            key, value = arg[2:], args[i + 1]
            i += 2
        out.append((key, value))
    return out
