"""The documentation cannot rot: the site builds with no warning, the configuration
reference is the code's, the README stays a front page, and every link in it resolves."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from llmtrain.config import SECTIONS, reference_markdown

MKDOCS = Path(sys.executable).with_name("mkdocs")


def test_the_site_builds_strict(tmp_path):
    """mkdocs-material with --strict: a broken link, a page missing from the nav or a
    markdown warning fails the build."""
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(MKDOCS.parent)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = {p.relative_to(tmp_path / "site").parts[0] for p in (tmp_path / "site").iterdir()}
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert pages <= built, pages - built  # every page is in the site (and the nav)
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f" {page}.md" in nav for page in pages), "a page is missing from mkdocs.yml's nav"


def test_the_config_reference_is_current():
    """docs/config.md is what `llmtrain config --reference` prints: a field added, removed
    or changed without regenerating it fails here."""
    page = (ROOT / "docs" / "config.md").read_text()
    assert page.rstrip("\n") == reference_markdown().rstrip("\n"), (
        "docs/config.md is stale: run `llmtrain config --reference > docs/config.md`")


def test_every_config_field_is_documented_in_the_reference():
    page = (ROOT / "docs" / "config.md").read_text()
    for name, section in SECTIONS.items():
        for f in dataclasses.fields(section):
            assert f.metadata.get("doc"), f"{name}.{f.name} has no doc= (llmtrain/config/sections.py)"
            row = next(line for line in page.splitlines()
                       if line.startswith(f"| `{name}.{f.name}` |"))
            assert f"| {f.type} |" in row


def test_the_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "../" not in text  # nothing outside the repository
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).exists(), link
    for path in re.findall(r"`((?:slurm|launchers|monitoring|docker)/[\w./-]+)`", text):
        assert (ROOT / path).exists(), path


def test_the_reference_changes_when_a_field_does(monkeypatch):
    """The freshness check above can fail: a new field shows in the generated page."""
    from llmtrain.config import sections as config
    extended = dataclasses.make_dataclass(
        "WarmConfig", [("new_knob", "int", config._f(1, ge=0, doc="a field just added"))],
        bases=(config.WarmConfig,))
    monkeypatch.setitem(config.SECTIONS, "warm", extended)
    assert "| `warm.new_knob` | int | `1` | ≥ 0 | a field just added |" in reference_markdown()
    assert reference_markdown() != (ROOT / "docs" / "config.md").read_text().rstrip("\n")

