"""The config reference (``docs/config.md``), generated from the section dataclasses."""

from __future__ import annotations

import dataclasses
import json

from llmtrain.config.parsing import preset_names, read_preset
from llmtrain.config.sections import SECTIONS


def reference_markdown() -> str:
    """Every field of every section as a Markdown reference (``docs/config.md``): the
    dataclasses are the one source, so the reference cannot drift from them."""
    out = ["# Configuration reference", "",
           "Generated from the `Config` dataclasses in `llmtrain/config/sections.py` by "
           "`llmtrain config --reference > docs/config.md`; a test fails when this page is "
           "stale. Set a field in a TOML file's `[section]` table (`--config my_run.toml`) "
           "or on the command line as `--section.field VALUE`. `llmtrain config` prints "
           "the resolved values.", "",
           "**What a run gets.** The \"default\" column is what a field holds when nothing "
           "sets it. With no `--config`, a run starts from the `debug_cpu` preset; "
           "`--config NAME` from another preset; a TOML file from this table's defaults, "
           "unless its top level names a preset to start from (`preset = \"debug_cpu\"`, "
           "or the path of another TOML file), its own fields on top. "
           "[Presets](#presets) lists every value a preset sets.", ""]
    for name, section in SECTIONS.items():
        out += [f"## {name}", "", " ".join((section.__doc__ or "").split()), "",
                "| field | type | default | allowed | what it does |",
                "| --- | --- | --- | --- | --- |"]
        for f in dataclasses.fields(section):
            md = f.metadata
            allowed = [" / ".join(f"`{c}`" for c in md["choices"])] if md.get("choices") else []
            allowed += [f"{word} {md[op]:g}" for op, word in
                        (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
                        if md.get(op) is not None]
            default = json.dumps(f.default)
            doc = md.get("doc", "")
            for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
                doc = doc.replace(char, escaped)
            out.append(f"| `{name}.{f.name}` | {f.type} | `{default}` | "
                       f"{', '.join(allowed) or 'any'} | {doc} |")
        out.append("")
    return "\n".join(out + _presets_table())


def _presets_table() -> list[str]:
    """One row per field any packaged preset sets: its default, then each preset's value
    (blank where the preset leaves the default)."""
    names = preset_names()
    tables = {name: read_preset(name) for name in names}
    defaults = {f"{section}.{f.name}": f.default
                for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    out = ["## Presets", "",
           "The packaged presets (`llmtrain/configs/*.toml`), each field they set beside "
           "its default.", "",
           "| field | default | " + " | ".join(f"`{n}`" for n in names) + " |",
           "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for key in defaults:
        section, _, field_name = key.partition(".")
        values = [tables[n].get(section, {}).get(field_name) for n in names]
        if all(v is None for v in values):
            continue
        cells = ["" if v is None else f"`{json.dumps(v)}`" for v in values]
        out.append(f"| `{key}` | `{json.dumps(defaults[key])}` | " + " | ".join(cells) + " |")
    return out + [""]
