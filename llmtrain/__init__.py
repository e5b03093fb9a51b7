"""llmtrain: FSDP2 + FP8 Llama training that survives the failures of large GPU jobs, and
the same reliability for any PyTorch training loop through a small public API
(:mod:`llmtrain.api`): ``llmtrain.start(settings, build)`` returns a :class:`Session`.

The API's names are imported on first use, so ``import llmtrain`` (the CLI's start) does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Action", "Parts", "RunInfo", "Session", "Settings", "Summary", "World", "start"]

if TYPE_CHECKING:
    from llmtrain.api import Action, Parts, RunInfo, Session, Settings, Summary, World, start


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("llmtrain.api"), name)
    raise AttributeError(f"module 'llmtrain' has no attribute {name!r}")
