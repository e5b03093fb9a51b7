"""Plain PyTorch gloo jobs with planted collective faults, and the flight-recorder dump of
every live rank: what ``llmtrain analyze`` must diagnose in a job that is not llmtrain's.

    python tests/fr_jobs.py OUT [CASE ...]    OUT/<case>/ holds one dump per live rank

The jobs import nothing of llmtrain: their dumps are what any PyTorch 2.13 job leaves,
named the way PyTorch names them (``<TORCH_FR_DUMP_TEMP_FILE prefix><rank>``): pickles
from ``_dump_fr_trace``, or JSON from ``_dump_fr_trace_json``. ``CASES`` says what each
job planted, for the tests to hold the analysis to; it lives with the tests because it is
their ground truth, not a measurement.

CPU gloo does not dump on a timeout, so each rank dumps its own recorder: once its
collective failed (a dead peer, a timeout) or, in the desync jobs, right after queueing the
planted collective. There the odd rank queues its version, the one that sends more bytes,
only once the others have dumped: gloo aborts a process that receives more than it
expects, dump or no dump. Ranks are forked from this process, which imports torch once,
so a job costs its planted waits.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Planted:
    """A fault as the analysis should name it: kind, process group, sequence number, ranks."""
    kind: str
    pg: str
    seq: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Case:
    world: int
    job: Callable[["_Rank"], None]
    planted: tuple[Planted, ...]
    timeout_s: float = 10.0
    prefix: str = "nccl_trace_rank_"  # of the dump files, as TORCH_FR_DUMP_TEMP_FILE's
    json: bool = False


class _Rank:
    """What a job sees of its process: its rank, and the dump and its bookkeeping."""

    def __init__(self, case: Case, rank: int, out: str, store: dist.Store):
        self.case, self.rank, self.out, self.store = case, rank, out, store
        self.live = case.world - sum(len(p.ranks) for p in case.planted if p.kind == "missing")
        self.dumped = False

    def dump(self) -> None:
        """This rank's recorder, without stacks: symbolizing them takes seconds a rank and
        the analysis reads none."""
        c10d = torch._C._distributed_c10d
        raw = c10d._dump_fr_trace_json() if self.case.json else \
            c10d._dump_fr_trace(includeStackTraces=False)
        name = f"{self.case.prefix}{self.rank}{'.json' if self.case.json else ''}"
        with open(os.path.join(self.out, f".{name}"), "wb") as f:
            f.write(raw)
        os.replace(os.path.join(self.out, f".{name}"), os.path.join(self.out, name))
        self.dumped = True
        self.store.add("dumped", 1)

    def wait_for_dumps(self, count: int) -> None:
        while self.store.add("dumped", 0) < count:
            time.sleep(0.05)


def _all_reduce(n: int = 4, dtype=torch.float32, group=None, wait: bool = True):
    work = dist.all_reduce(torch.ones(n, dtype=dtype), group=group, async_op=True)
    return work.wait() if wait else work


def _missing(me: _Rank) -> None:
    """Rank 2 dies between two collectives; the others fail in the second."""
    _all_reduce()
    if me.rank == 2:
        os._exit(1)
    _all_reduce()


def _late(me: _Rank) -> None:
    """Rank 1 comes to the second collective after the others' timeout has expired."""
    _all_reduce()
    if me.rank == 1:
        time.sleep(3 * me.case.timeout_s)
    _all_reduce()


def _desync(odd: int, call: Callable[[], object]) -> Callable[[_Rank], None]:
    """Collective #2 differs on rank ``odd`` (``call`` queues its version), #3 matches
    again: the fault is not the newest collective any rank recorded."""
    def job(me: _Rank) -> None:
        _all_reduce()
        if me.rank == odd:
            me.wait_for_dumps(me.live - 1)
            call()
        else:
            _all_reduce(wait=False)
        _all_reduce(wait=False)
        me.dump()
    return job


def _subgroup_desync(me: _Rank) -> None:
    """World of 4; in group "tp" (ranks 1-3) rank 3 broadcasts as #2 where 1 and 2
    all-reduce, and the default group goes on (its #2)."""
    tp = dist.new_group([1, 2, 3], group_desc="tp")
    _all_reduce()
    if me.rank in (1, 2, 3):
        _all_reduce(group=tp)
        if me.rank == 3:
            me.wait_for_dumps(me.live - 1)
            dist.broadcast(torch.ones(4), src=3, group=tp, async_op=True)
        else:
            _all_reduce(group=tp, wait=False)
    _all_reduce(wait=False)
    me.dump()


def _two_groups(me: _Rank) -> None:
    """Two groups stuck at once: rank 2 skips default #2, rank 1 skips "side" #2."""
    side = dist.new_group([0, 1, 2], group_desc="side")
    _all_reduce()
    _all_reduce(group=side)
    if me.rank != 2:
        _all_reduce(wait=False)
    if me.rank != 1:
        _all_reduce(group=side, wait=False)
    me.dump()


def _tp_blocked(me: _Rank) -> None:
    """Tensor parallel inside data parallel, 4 ranks: tp pairs [0, 1] and [2, 3], dp
    pairs [0, 2] and [1, 3]. Rank 0 stops before tp_a #2 (as SIGSTOP would: it never
    dumps, its connections stay open): rank 1 waits in tp_a #2 and so never arrives at
    dp_b #2, where rank 3 waits for it. Rank 1 is blocked, not a culprit."""
    tps = [dist.new_group([0, 1], group_desc="tp_a"), dist.new_group([2, 3], group_desc="tp_b")]
    dps = [dist.new_group([0, 2], group_desc="dp_a"), dist.new_group([1, 3], group_desc="dp_b")]
    tp, dp = tps[me.rank // 2], dps[me.rank % 2]
    _all_reduce(group=tp)
    _all_reduce(group=dp)
    if me.rank == 0:
        me.wait_for_dumps(me.live)
        os._exit(0)
    _all_reduce(group=tp, wait=me.rank != 1)
    if me.rank == 3:
        _all_reduce(group=dp, wait=False)
    me.dump()


CASES: dict[str, Case] = {
    "missing_rank": Case(3, _missing, (Planted("missing", "default_pg", 2, (2,)),),
                         prefix="comm_lib_trace_rank_"),
    "late_rank": Case(3, _late, (Planted("late", "default_pg", 2, (1,)),), timeout_s=1.5,
                      prefix="fr_trace_rank_", json=True),
    "op_mismatch": Case(3, _desync(1, lambda: dist.broadcast(torch.ones(4), src=1,
                                                             async_op=True)),
                        (Planted("op_mismatch", "default_pg", 2, (1,)),)),
    "size_mismatch": Case(3, _desync(2, lambda: _all_reduce(8, wait=False)),
                          (Planted("size_mismatch", "default_pg", 2, (2,)),)),
    "dtype_mismatch": Case(3, _desync(0, lambda: _all_reduce(dtype=torch.float64,
                                                             wait=False)),
                           (Planted("dtype_mismatch", "default_pg", 2, (0,)),)),
    "subgroup_mismatch": Case(4, _subgroup_desync, (Planted("op_mismatch", "tp", 2, (3,)),)),
    "two_groups": Case(3, _two_groups, (Planted("never_arrived", "default_pg", 2, (2,)),
                                        Planted("never_arrived", "side", 2, (1,)))),
    "tp_blocked": Case(4, _tp_blocked, (Planted("missing", "tp_a", 2, (0,)),)),
}


def _run_rank(case: Case, rank: int, out: str, store_path: str) -> None:
    """One rank: its job, its dump (unless the job made it), then it waits for the other
    live ranks' dumps and leaves, whatever its queued collectives are doing."""
    torch.set_num_threads(1)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"  # on: read when the first group is made
    store = dist.FileStore(store_path, case.world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=case.world,
                            timeout=datetime.timedelta(seconds=case.timeout_s))
    me = _Rank(case, rank, out, store)
    try:
        case.job(me)
    except RuntimeError:
        pass  # the planted fault, as this rank met it
    if not me.dumped:
        me.dump()
    me.wait_for_dumps(me.live)
    os._exit(0)


def generate(out: str, names: list[str] | None = None) -> dict[str, str]:
    """Runs the cases (all by default) one after another; returns case -> dump directory."""
    forked = multiprocessing.get_context("fork")
    stores = tempfile.mkdtemp(prefix="fr_jobs-")
    dirs = {}
    try:
        for name in names or list(CASES):
            case, dirs[name] = CASES[name], os.path.join(out, name)
            os.makedirs(dirs[name])
            procs = [forked.Process(target=_run_rank, args=(case, r, dirs[name],
                                                             os.path.join(stores, name)))
                     for r in range(case.world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + 60
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
    finally:
        shutil.rmtree(stores)
    return dirs


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for case_name, path in generate(sys.argv[1], sys.argv[2:] or None).items():
        print(f"{case_name}: {path}")
