"""The RNG states a rank saves in a checkpoint and restores from it (on a GPU: its own):
the registry's ``rng`` item."""

import io
import random

import torch

from llmtrain.checkpoint.safe_unpickle import stored_object
from llmtrain.state_registry import RngState, _own_gpu_rng

CUDA1 = torch.device("cuda", 1)


def _saved(device) -> dict:
    """The state as a checkpoint holds it: torch.save'd, decoded as a load decodes it."""
    buf = io.BytesIO()
    torch.save(RngState(device).state_dict(), buf)
    return stored_object(buf.getvalue())


def test_a_rank_saves_its_own_gpus_rng_and_no_other(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device: torch.tensor([device.index], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: 1 / 0)
    assert list(_saved(CUDA1)["cuda"]) == [1]
    assert "cuda" not in _saved(torch.device("cpu"))


def test_a_rank_restores_its_own_gpus_rng_also_from_an_old_checkpoints_list(monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: restored.append((state.tolist(), device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: 1 / 0)
    gpus = [torch.tensor([i], dtype=torch.uint8) for i in range(4)]
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    RngState(CUDA1).load_state_dict({**state, "cuda": gpus})  # older: every visible GPU's
    RngState(CUDA1).load_state_dict({**state, "cuda": gpus[1]})
    assert restored == [([1], CUDA1), ([1], CUDA1)]
    assert _own_gpu_rng(gpus, 2) is gpus[2] and _own_gpu_rng(gpus[3], 2) is gpus[3]


def test_cpu_state_round_trips_as_plain_values(monkeypatch):
    monkeypatch.setattr(torch, "load", lambda *a, **k: 1 / 0)  # decoded without torch.load
    saved = _saved(torch.device("cpu"))
    expected = torch.rand(3), random.random()
    RngState(torch.device("cpu")).load_state_dict(saved)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]



def test_pythons_state_is_packed_words_and_an_older_tuple_of_ints_still_restores():
    cpu = torch.device("cpu")
    saved = _saved(cpu)
    words = saved["python"][1]
    assert isinstance(words, bytes) and len(words) == 4 * len(random.getstate()[1])
    expected = random.random()
    RngState(cpu).load_state_dict(saved)
    assert random.random() == expected
    older = random.getstate()  # its words a tuple of ints, as checkpoints before held them
    expected = random.random()
    RngState(cpu).load_state_dict({**saved, "python": older})
    assert random.random() == expected
