"""Fleet failure mixes for chaos (llmtrain/chaos/mix.py, summary.py): the shipped Llama 3 mix,
refusals that name the bad entry, and the weighted rates of the verdict table."""

import pytest

from llmtrain.chaos.kinds import KINDS
from llmtrain.chaos.mix import load_mix
from llmtrain.chaos.summary import weighted
from llmtrain.config import ConfigError


def test_the_shipped_llama3_mix_weighs_the_419_unexpected_interruptions():
    weights, source = load_mix("llama3")
    assert sum(weights.values()) == 419 and "Llama 3" in source
    assert set(weights) <= set(KINDS)
    assert max(weights, key=weights.get) == "gpu_bad"  # GPU faults dominate, as at scale
    assert weights["preempt"] == 32  # host maintenance


@pytest.mark.parametrize("body, message", [
    ('[categories]\n"Cosmic rays" = { count = 3, kind = "cosmic" }', "'Cosmic rays' names kind"),
    ('[categories]\n"GPU" = { count = -1, kind = "gpu_bad" }', "'GPU' needs a count >= 0"),
    ('[categories]\n"GPU" = { count = 0, kind = "gpu_bad" }', "no [categories]"),
    ("[categories\n", "not valid TOML"),
])
def test_a_bad_mix_is_refused_naming_what_to_fix(tmp_path, body, message):
    path = tmp_path / "mix.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_mix(str(path))


def test_rates_are_weighted_by_the_mix_over_the_kinds_that_ran():
    mix = {"gpu_bad": 3.0, "hang": 1.0, "eio": 4.0}
    verdicts = [{"kind": "gpu_bad", "detected": True, "correct": True},
                {"kind": "gpu_bad", "detected": True, "correct": False},
                {"kind": "hang", "detected": False, "correct": False}]
    got = weighted(verdicts, mix)
    assert got["weighted_detected"] == pytest.approx(3 / 4)       # (3·1 + 1·0) / 4
    assert got["weighted_correct"] == pytest.approx(3 * 0.5 / 4)  # (3·½ + 1·0) / 4
    assert got["mix_covered"] == pytest.approx(4 / 8)
