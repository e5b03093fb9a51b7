"""Chaos fault kinds register themselves (llmtrain/chaos/runner.py): one table of kinds,
which the default schedule runs and unknown names are refused against."""

import pytest

from llmtrain.chaos.runner import FAULT_KINDS, KINDS, Chaos, ChaosConfig
from llmtrain.config import ConfigError


def test_every_kind_is_a_chaos_method_and_the_default_runs_them_all():
    assert KINDS == tuple(FAULT_KINDS)
    for name, kind in FAULT_KINDS.items():
        assert kind.name == name and getattr(Chaos, kind.inject.__name__) is kind.inject
    assert ChaosConfig().faults.split(",") == list(KINDS)
    assert [k for k in KINDS if FAULT_KINDS[k].needs_netns] == ["partition", "lossy_link"]


def test_an_unknown_kind_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown fault kind\(s\) \['bogus'\]; known: ") as e:
        Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="hang,bogus"))
    assert all(kind in str(e.value) for kind in KINDS)
