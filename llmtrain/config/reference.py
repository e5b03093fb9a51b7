"""The config reference (``docs/config.md``), generated from the section dataclasses."""

from __future__ import annotations

import dataclasses
import json

from llmtrain.config.sections import SECTIONS


def reference_markdown() -> str:
    """Every field of every section as a Markdown reference (``docs/config.md``): the
    dataclasses are the one source, so the reference cannot drift from them."""
    out = ["# Configuration reference", "",
           "Generated from the `Config` dataclasses in `llmtrain/config/sections.py` by "
           "`llmtrain config --reference > docs/config.md`; a test fails when this page is "
           "stale. Set a field in a TOML file's `[section]` table (`--config my_run.toml`) "
           "or on the command line as `--section.field VALUE`. `llmtrain config` prints "
           "the resolved values.", ""]
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
    return "\n".join(out)
