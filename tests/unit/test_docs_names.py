"""Every dotted ``llmtrain.…`` name the docs give a reader (a module, a class, a function,
an attribute) exists: a module split or a rename that leaves the docs pointing at nothing
fails here."""

import importlib
import re

import pytest
from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "examples").rglob("*.md"))]
# a dotted name not preceded by a path separator or a word character (slurm/llmtrain.sbatch
# is a file)
NAME = re.compile(r"(?<![\w/.-])llmtrain(?:\.[A-Za-z_]\w*)+")
# ``from llmtrain.x import a, b`` in the docs' code: llmtrain.x.a and llmtrain.x.b
FROM_IMPORT = re.compile(r"from (llmtrain(?:\.\w+)*) import (?:\(([\w,\s]+)\)|([\w, ]+))")


def documented_names() -> dict[str, str]:
    """Each dotted name, with the first page that gives it."""
    names: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        found = NAME.findall(text)
        for module, wrapped, imported in FROM_IMPORT.findall(text):
            found += [f"{module}.{n.strip()}" for n in (wrapped or imported).split(",")
                      if n.strip()]
        for name in found:
            names.setdefault(name, str(page.relative_to(ROOT)))
    return names


def resolve(name: str) -> object:
    """The object ``name`` stands for: the longest importable module prefix, then
    attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


NAMES = documented_names()


def test_the_docs_name_things():
    assert len(NAMES) > 10, NAMES  # the pattern still finds the docs' names


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_documented_name_exists(name):
    try:
        resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{NAMES[name]} names {name}, which does not exist ({e})")
