"""Under CI=true a skip is a failure unless a mark of the test declares it (tests/needs.py's
plugin): pytest run on a small test file, with and without CI=true."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

TESTS = '''
import pytest
import needs

def test_skips():
    pytest.skip("no such tool")

def test_imports_or_skips():
    pytest.importorskip("llmtrain_no_such_module")

def test_needs_a_module():
    needs.module("llmtrain_no_such_module", "pip install it")

@pytest.mark.skipif(True, reason="needs a GPU")
def test_gpu_only():
    pass

@pytest.mark.skip(reason="opt-in: RUN_IT=1")
def test_opt_in():
    pass

@pytest.mark.skipif(False, reason="needs a GPU")
def test_declares_one_skip_takes_another():
    pytest.skip("something else is missing")

@pytest.fixture
def missing():
    needs.unavailable("fuse3 is not installed")

def test_with_a_missing_fixture(missing):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_known_failure():
    assert False

def test_passes():
    pass
'''


def outcomes(tmp_path, ci: str) -> tuple[dict[str, str], list[str]]:
    """Each test's outcome but skips, by name; and the reasons of the skips."""
    (tmp_path / "test_some.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "test_skipped_module.py").write_text(
        "import pytest\npytest.importorskip('llmtrain_no_such_module')\n\n"
        "def test_never_collected():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "needs", "-p",
                           "no:cacheprovider", "-rA", "--continue-on-collection-errors",
                           "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
                           str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    found, skips = {}, []
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "SKIPPED":  # "SKIPPED [1] file:line: reason"
            skips.append(rest.split(": ", 1)[1])
        elif word in ("PASSED", "FAILED", "XFAIL", "ERROR"):
            found[rest.split(" ")[0].rsplit("::", 1)[-1].removesuffix(".py")] = word
    return found, skips


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_skip_fails_under_ci_unless_a_mark_declares_it(tmp_path, ci):
    found, skips = outcomes(tmp_path, ci)
    declared = ["needs a GPU", "opt-in: RUN_IT=1"]
    undeclared = {"test_skips": "no such tool",
                  "test_imports_or_skips": "could not import 'llmtrain_no_such_module'",
                  "test_needs_a_module": "llmtrain_no_such_module cannot be imported",
                  "test_declares_one_skip_takes_another": "something else is missing",
                  "test_with_a_missing_fixture": "fuse3 is not installed",
                  "test_skipped_module": "could not import 'llmtrain_no_such_module'"}
    expected = {"test_known_failure": "XFAIL", "test_passes": "PASSED"}
    if ci:  # failures, in the test's set-up or as the module is collected errors
        expected.update({name: "FAILED" for name in undeclared},
                        test_with_a_missing_fixture="ERROR", test_skipped_module="ERROR")
    assert found == expected
    if ci:
        assert sorted(skips) == sorted(declared)
    else:
        assert len(skips) == len(declared) + len(undeclared)
        for reason in (*declared, *undeclared.values()):
            assert any(s.startswith(reason) for s in skips), (reason, skips)
