"""The cyclic collector paused over imports and loads (llmtrain.collector)."""

import gc

from llmtrain import collector


def test_paused_collects_nothing_inside_and_freezes_what_was_made_when_asked():
    frozen = gc.get_freeze_count()
    try:
        with collector.paused(freeze=True):
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]  # tracked containers, as modules make
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
        with collector.paused():
            pass
        assert gc.isenabled()
        gc.disable()  # a caller that had it off keeps it off
        with collector.paused(freeze=False):
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
