"""Fleet failure mixes (``llmtrain chaos --mix``): the weights by which a chaos run draws
its fault kinds, as a fleet fails; shipped ones live in ``llmtrain/chaos/mixes``."""

from __future__ import annotations

import tomllib
from pathlib import Path

from llmtrain.chaos.kinds import FAULT_KINDS, KINDS
from llmtrain.config import ConfigError

MIXES = Path(__file__).parent / "mixes"


def load_mix(name_or_path: str) -> tuple[dict[str, float], str]:
    """A fault mix: (kind -> weight, its source). A TOML file (or the name of one shipped
    in ``llmtrain/chaos/mixes``) with ``source`` and a ``[categories]`` table of
    ``"cause" = { count = N, kind = "..." }``; a kind's weight is its causes' counts."""
    path = Path(name_or_path)
    if not path.exists() and (MIXES / f"{name_or_path}.toml").exists():
        path = MIXES / f"{name_or_path}.toml"
    shipped = sorted(p.stem for p in MIXES.glob("*.toml"))
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--mix {name_or_path}: no such file, and no shipped mix of that "
                          f"name (shipped: {shipped})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--mix {path}: not valid TOML ({e})") from None
    weights: dict[str, float] = {}
    for cause, entry in doc.get("categories", {}).items():
        kind, count = entry.get("kind"), entry.get("count")
        if kind not in FAULT_KINDS:
            raise ConfigError(f"--mix {path}: {cause!r} names kind {kind!r}; choose from {KINDS}")
        if not isinstance(count, (int, float)) or count < 0:
            raise ConfigError(f"--mix {path}: {cause!r} needs a count >= 0, not {count!r}")
        weights[kind] = weights.get(kind, 0) + count
    weights = {k: w for k, w in weights.items() if w > 0}
    if not weights:
        raise ConfigError(f"--mix {path}: no [categories] with a count above 0")
    return weights, str(doc.get("source", path))
