"""The docs' cheap shell commands run as written, against a finished run in a directory of
their own; and the run report, opened in a real browser (headless Chromium), shows its
figures without a console error."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, check, llmtrain
from needs import tool

from llmtrain.distributed.process_group import free_port

MARK = "<!-- docs-test -->"
# every command family the docs promise can be run; a block that loses its mark fails here
PROMISED = ("llmtrain --help", "llmtrain config", "llmtrain ckpt list", "llmtrain ckpt verify",
            "llmtrain ckpt inspect", "llmtrain analyze", "llmtrain report", "llmtrain launch",
            "llmtrain rdzv-store", "load_unsharded")


def marked_blocks() -> list[tuple[str, str]]:
    """(page, script) of each ```sh block right after the mark, in README.md and docs/."""
    blocks = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for script in re.findall(re.escape(MARK) + r"\n```sh\n(.*?)```", page.read_text(),
                                 re.S):
            blocks.append((page.name, script))
    return blocks


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """What the docs' commands assume: ``runs/debug_cpu`` a finished run of ``make train``
    (the Makefile's own recipe: torchrun, 2 ranks, the debug_cpu preset; 20 steps, not the
    preset's 200, with checkpoints at steps 10 and 20), and ``docs/`` and ``examples/``
    beside it."""
    work = tmp_path_factory.mktemp("docs")
    bin_dir = Path(sys.executable).parent
    args = (f"--training.run_dir {work / 'runs' / 'debug_cpu'} --training.steps 20 "
            f"--checkpoint.interval_steps 10 --metrics.port 0")
    # this interpreter's venv, taken as built (-o: never reinstalled from here)
    check(subprocess.run(["make", "-C", str(ROOT), "train", f"BIN={bin_dir}",
                          "-o", f"{bin_dir}/llmtrain", f"ARGS={args}"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}))
    for shown in ("docs", "examples"):
        (work / shown).symlink_to(ROOT / shown)
    return work


BLOCKS = marked_blocks()


def test_the_docs_promise_the_cheap_commands():
    scripts = "\n".join(script for _, script in BLOCKS)
    for command in PROMISED:
        assert command in scripts, f"no {MARK} block runs {command!r}"


@pytest.mark.parametrize("page,script", BLOCKS, ids=[f"{p}:{i}" for i, (p, _) in
                                                    enumerate(BLOCKS)])
def test_a_documented_command_runs(workdir, page, script):
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "HOME": str(workdir), "PORT": str(free_port())}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{page}:\n{script}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), script
    if "llmtrain analyze docs/examples/desync" in script:  # the page says what it finds
        assert "desync at gloo:all_reduce #2" in proc.stdout and "rank(s) [1]" in proc.stdout
    if "runs/cnn --training.steps 30" in script:  # the own loop's second run resumes
        assert "resumed from the checkpoint of step 20" in proc.stdout, proc.stdout[-3000:]
    if "kill -9 $(tree $node2)" in script:  # the single-machine cluster: a spare took over
        assert re.search(r"warm recovery: rank\(s\) \[\d\] replaced by spare", proc.stdout), \
            proc.stdout
    if "ckpt list" in script:
        assert re.search(r"\b20\s+committed", proc.stdout), proc.stdout


def test_the_run_report_opens_in_a_browser_with_its_figures(workdir):
    """Debian's chromium through Playwright: no console error or page error, the timeline
    and goodput figures decoded (an image that fails to load has no natural width), the
    goodput figures in the text, and a screenshot beside the report."""
    chromium = tool("chromium", "apt-get install chromium")
    from playwright.sync_api import sync_playwright
    run = workdir / "runs" / "debug_cpu"
    out = workdir / "report"
    check(subprocess.run([sys.executable, "-m", "llmtrain", "report", str(run), "--out",
                          str(out)], capture_output=True, text=True, timeout=300))
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: m.type == "error" and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto((out / "index.html").as_uri(), wait_until="load")
        widths = {alt: page.eval_on_selector(f'img[alt="{alt}"]', "i => i.naturalWidth")
                  for alt in ("Timeline", "Goodput")}
        text = page.inner_text("body")
        page.screenshot(path=str(out / "screenshot.png"), full_page=True)
        browser.close()
    assert problems == []
    assert all(w > 100 for w in widths.values()), widths
    assert "ETTR" in text, text[:2000]
    shot = (out / "screenshot.png").read_bytes()
    assert shot.startswith(b"\x89PNG") and len(shot) > 20_000
