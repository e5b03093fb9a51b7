"""`llmtrain analyze` on the dumps of plain PyTorch gloo jobs (tests/fr_jobs.py), each with
a planted fault: named by kind, process group, sequence number and rank, with no
--world-size. One generation run serves every test."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from fr_jobs import CASES
from llmtrain.reliability.flightrec import analyze, load_dumps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fr_jobs")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fr_jobs.py"), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_planted_fault_is_named(jobs, name):
    case = CASES[name]
    gone = sorted(r for p in case.planted if p.kind == "missing" for r in p.ranks)
    dumps = load_dumps(str(jobs / name))
    assert sorted(dumps) == [r for r in range(case.world) if r not in gone]
    report = analyze(dumps)
    said = report.to_markdown()
    named = {(f.kind, f.pg, f.seq, tuple(f.ranks)) for f in report.findings}
    for p in case.planted:
        assert (p.kind, p.pg, p.seq, p.ranks) in named, said
        assert f"rank(s) {list(p.ranks)}" in report.verdict, said
        assert f"#{p.seq} on process group {p.pg}" in report.verdict, said
    assert report.culprits == sorted({r for p in case.planted for r in p.ranks}), said
    assert report.missing_dumps == gone, said


def test_cli_reports_every_stuck_group_and_what_it_cannot_tell(jobs):
    out = subprocess.run([sys.executable, "-m", "llmtrain", "analyze",
                          str(jobs / "two_groups"), "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["culprits"] == [1, 2]
    assert {(f["pg"], f["seq"], tuple(f["ranks"])) for f in report["findings"]
            if f["kind"] == "never_arrived"} == {("default_pg", 2, (2,)), ("side", 2, (1,))}
    # gloo lists no group's ranks once a second group exists: the world cannot be known
    assert any("whether ranks above 2 are missing cannot be told" in f["text"]
               for f in report["findings"] if f["kind"] == "cannot_tell")
    never = next(f["text"] for f in report["findings"] if f["ranks"] == [2])
    assert "its newest collective is gloo:all_reduce #2 on side" in never
