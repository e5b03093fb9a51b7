"""The run's state registry (:mod:`llmtrain.state_registry`) in a snapshot, and back.

A snapshot holds this rank's sharded tensors (model and optimizer) as bytes, and every
registered item in its JSON header, the same items a checkpoint holds: the items shared by
every rank (``shared``) apart from this rank's own (``own``: its RNGs), bytes as
``{"b64": ...}``. A spare restores a lost rank's own items with its shards.
"""

from __future__ import annotations

import base64

from llmtrain.checkpoint.snapshots import Snapshot, Snapshots, capture
from llmtrain.state_registry import StateRegistry


def _plain(x):
    """JSON for a snapshot's header: bytes as {"b64": ...}, tuples as lists."""
    if isinstance(x, bytes):
        return {"b64": base64.b64encode(x).decode()}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return [_plain(v) for v in x] if isinstance(x, (tuple, list)) else x


def _unplain(x):
    if isinstance(x, dict):
        return base64.b64decode(x["b64"]) if x.keys() == {"b64"} else {
            k: _unplain(v) for k, v in x.items()}
    return [_unplain(v) for v in x] if isinstance(x, list) else x


def _header(registry: StateRegistry) -> dict:
    return {"shared": _plain(registry.shared()), "own": _plain(registry.own())}


def take_snapshot(snapshots: Snapshots, step: int, registry: StateRegistry) -> bool:
    """The registry at ``step`` into this rank's next snapshot: the sharded tensors as
    bytes, every item in the header (False: skipped, the last still being replicated)."""
    return snapshots.take(step, registry.tensors(), _header(registry))


def capture_state(step: int, rank: int, registry: StateRegistry) -> Snapshot:
    """The registry at ``step``, copied into memory outside the snapshot schedule: what a
    resize that nothing broke reshards from."""
    return capture(step, rank, registry.tensors(), _header(registry))


def restore_snapshot(snap: Snapshot, registry: StateRegistry) -> None:
    """The registry as ``snap`` (verified) holds it: a spare takes the lost rank's own
    items (its RNGs) with its shards."""
    load_items(snap.restore_into(registry.tensors()), registry)


def load_items(header: dict, registry: StateRegistry) -> None:
    """Every item of a snapshot's ``header``, shared and own, into the registry."""
    registry.load({**_unplain(header["shared"]), **_unplain(header["own"])})


def load_shared_items(header: dict, registry: StateRegistry) -> None:
    """The shared items of a snapshot's ``header`` into the registry, this rank's own
    (its RNGs) left as they were built: a newcomer's, which held no rank before."""
    registry.load(_unplain(header["shared"]))
