"""This process's collective flight recorder (``TORCH_FR_BUFFER_SIZE``, gloo and NCCL): what
it holds, for a hang's diagnosis (:mod:`llmtrain.reliability.watchdog`), and the collective
the training thread is stuck in, for a rank that must leave a failed generation
(:mod:`llmtrain.recovery.coordinator`); and, beside it, where each thread's Python stack
stands, and what each native thread waits in."""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from llmtrain.distributed.group_names import OFF_THREAD, group_label


def flight_recorder(since_ns: int = 0) -> dict:
    """This process's recorder: its entries made since ``since_ns``, and each group's
    ranks (``pg_config``) and progress (``pg_status``), which tell the analysis who belongs
    where. On NCCL, NCCL's own recorder (the GPU collectives) joins the common one (gloo,
    and the CPU side). The recorder outlives the groups: a warm recovery's survivor still
    holds the entries of the generations before, whose groups had the same names and ids
    (torch numbers them from 0 again once the world is destroyed) and other members, so
    ``since_ns`` is the generation's start."""
    c10d = torch._C._distributed_c10d
    out = {"entries": [], **json.loads(c10d._dump_fr_trace_json(includeCollectives=True,
                                                                onlyActive=False))}
    if dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(
            c10d, "_dump_nccl_trace_json"):
        nccl = json.loads(c10d._dump_nccl_trace_json(includeCollectives=True, onlyActive=False))
        out["entries"] += nccl.get("entries", [])
        for key in ("pg_config", "pg_status"):
            out[key] = {**out.get(key, {}), **nccl.get(key, {})}
    out["entries"] = [e for e in out["entries"] if (e.get("time_created_ns") or 0) >= since_ns]
    return out


def stuck_collective(since_ns: int, before_ns: int) -> dict | None:
    """The collective the training thread entered between ``since_ns`` (its generation's
    start) and ``before_ns`` and is still inside: its newest of the generation on a group
    of the training thread's (not :data:`OFF_THREAD`), not yet ended. None when that one
    ended (the thread computes, or went on), it entered one since ``before_ns``, or the
    recorder is off. On gloo an entry ends only once its work object is freed: a caller
    that still holds one that ended looks inside it, so ask only where the thread should
    have left by now."""
    own = [e for e in flight_recorder(since_ns)["entries"]
           if not _group(e)[1].startswith(OFF_THREAD)]
    if not own:
        return None
    newest = _newest(own)
    if newest.get("retired", True) or (newest.get("time_created_ns") or 0) >= before_ns:
        return None
    return _described(newest)


def pending_on(desc: str, since_ns: int = 0) -> dict | None:
    """The newest collective on the group described ``desc`` (its ``group_desc``) entered
    since ``since_ns`` that has not ended: ``op``, ``seq``, ``pg`` and ``entered_ns``; None
    when none waits there, or the recorder is off. What a wait for that group's thread is
    stuck behind (``since_ns``: when that work began; an older wait is another's)."""
    waiting = [e for e in flight_recorder(since_ns)["entries"]
               if _group(e)[1] == desc and not e.get("retired", True)]
    return _described(_newest(waiting)) if waiting else None


def _newest(entries: list[dict]) -> dict:
    return max(entries, key=lambda e: e.get("time_created_ns") or 0)


def _described(entry: dict) -> dict:
    """An entry as the callers name a collective: ``op``, ``seq``, ``pg``, ``entered_ns``."""
    return {"op": entry.get("profiling_name"), "seq": entry.get("collective_seq_id"),
            "pg": group_label(*_group(entry)), "entered_ns": entry.get("time_created_ns")}


def _group(entry: dict) -> tuple[str, str]:
    """An entry's group: its name and its description ("" without one)."""
    pg = entry.get("process_group") or ["?"]
    return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""


def thread_stacks() -> dict[str, str]:
    """Each thread's Python stack, by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(ident, str(ident)): "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()}


def native_threads() -> dict[str, list[str]]:
    """What each native thread of this process waits in, as the kernel says (its
    ``wchan``; ``running`` for one on a CPU), grouped by thread name: gloo's loop
    threads (``gloo_tcp_loop``, one per group) wait in epoll while they watch their
    connections; one waiting on a lock (``futex...``) handles no connection's close.
    Empty where ``/proc`` cannot be read."""
    found: dict[str, list[str]] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rpartition(") ")[2][:1]
            with open(f"/proc/self/task/{tid}/wchan") as f:
                wait = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        found.setdefault(name, []).append("running" if state == "R" else wait or state)
    return {name: sorted(waits) for name, waits in sorted(found.items())}
