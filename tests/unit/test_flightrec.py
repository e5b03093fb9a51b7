import json
import os
import pickle
import subprocess
import sys

import pytest

from llmtrain.distributed.group_names import OFF_THREAD
from llmtrain.reliability.flightrec import analyze, load_dumps


def entry(seq: int, op: str = "gloo:all_reduce", sizes=((1024,),), done: bool = True,
          pg=("0", "default_pg")) -> dict:
    return {"collective_seq_id": seq, "profiling_name": op, "input_sizes": [list(s) for s in sizes],
            "input_dtypes": ["Float"], "retired": done, "state": "scheduled",
            "process_group": list(pg), "is_p2p": False}


def dump(rank: int, *entries: dict, stack: str = "") -> dict:
    return {"rank": rank, "entries": list(entries), "stacks": {"MainThread": stack or f"rank {rank}"}}


def test_rank_that_never_arrived_is_the_culprit():
    dumps = {0: dump(0, entry(1), entry(2, done=False)),
             1: dump(1, entry(1), stack="time.sleep in data loading"),
             2: dump(2, entry(1), entry(2, done=False))}
    r = analyze(dumps, world_size=3)
    assert r.culprits == [1] and r.stuck == [0, 2]
    assert r.collective == {"pg": "default_pg", "seq": 2, "op": "gloo:all_reduce",
                            "sizes": [[1024]], "dtypes": ["Float"]}
    assert "rank(s) [1] never reached gloo:all_reduce #2" in r.verdict
    assert "time.sleep in data loading" in r.stacks[1]
    assert "never arrived" in r.details[0]


def test_desync_by_size_and_by_op_names_the_odd_rank():
    sizes = {0: dump(0, entry(1), entry(2, done=False)),
             1: dump(1, entry(1), entry(2, done=False)),
             2: dump(2, entry(1), entry(2, sizes=((2048,),), done=False))}
    r = analyze(sizes)
    assert r.culprits == [2] and "desync" in r.verdict and "[[2048]]" in r.verdict
    ops = {0: dump(0, entry(5, done=False)), 1: dump(1, entry(5, op="gloo:all_gather", done=False))}
    r = analyze({**ops, 2: dump(2, entry(5, done=False))})
    assert r.culprits == [1] and "gloo:all_gather" in r.verdict


def test_two_ranks_that_disagree_are_both_named():
    """With no majority, which rank is wrong cannot be told: both are named, and said so."""
    r = analyze({0: dump(0, entry(5, done=False)),
                 1: dump(1, entry(5, op="gloo:all_gather", done=False))})
    assert r.culprits == [0, 1] and "no majority" in r.verdict
    assert "rank 0 called gloo:all_reduce" in r.verdict and "rank 1 called gloo:all_gather" in r.verdict


def test_missing_dump_is_the_likely_culprit():
    r = analyze({0: dump(0, entry(1), entry(2, done=False))}, world_size=2)
    assert r.culprits == [1] and r.missing_dumps == [1]
    assert "wrote no dump" in " ".join(r.details)
    quiet = analyze({0: dump(0, entry(1))}, world_size=2)
    assert quiet.collective is None and quiet.culprits == [1]


def test_stuck_group_is_found_among_several():
    other = ("1", "checkpoint")
    dumps = {0: dump(0, entry(7, pg=other), entry(3), entry(4, done=False)),
             1: dump(1, entry(7, pg=other), entry(3))}
    r = analyze(dumps)
    assert r.collective["pg"] == "default_pg" and r.collective["seq"] == 4 and r.culprits == [1]


def test_cli_reads_pytorch_pickles_and_llmtrain_json(tmp_path):
    # PyTorch's own dump format: a pickle per rank, the rank at the end of the file name
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(
        {"version": "2.10", "entries": [entry(1), entry(2, done=False)]}))
    (tmp_path / "rank-00001.json").write_text(json.dumps(dump(1, entry(1))))
    assert sorted(load_dumps(str(tmp_path))) == [0, 1]
    out = subprocess.run([sys.executable, "-m", "llmtrain", "analyze", str(tmp_path),
                          "--world-size", "3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "culprit rank(s): [1, 2]" in out.stdout and "gloo:all_reduce` #2" in out.stdout


def test_desync_check_errors_give_the_odd_rank():
    msg = ("RuntimeError: Detected mismatch between collectives on ranks. Rank {a} is running "
           "collective: CollectiveFingerPrint(SequenceNumber=46, OpType=ALLREDUCE, "
           "TensorShape=[{sa}], TensorDtypes=Float, TensorDeviceTypes=cpu), but Rank {b} is "
           "running collective: CollectiveFingerPrint(SequenceNumber=46, OpType=ALLREDUCE, "
           "TensorShape=[{sb}], TensorDtypes=Float, TensorDeviceTypes=cpu)")
    dumps = {0: {**dump(0), "error": msg.format(a=0, sa=16, b=1, sb=20)},
             1: {**dump(1), "error": msg.format(a=1, sa=20, b=0, sb=16)},
             2: {**dump(2), "error": msg.format(a=2, sa=16, b=1, sb=20)}}
    r = analyze(dumps)
    assert r.culprits == [1] and r.stuck == [0, 2]
    assert "rank(s) [1] called ALLREDUCE shape [20]" in r.verdict


REAL_DUMP = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
sys.stdout.buffer.write(torch._C._distributed_c10d._dump_fr_trace())
dist.destroy_process_group()
"""


def test_pytorchs_own_pickled_dump_loads_as_plain_data(tmp_path):
    raw = subprocess.run([sys.executable, "-c", REAL_DUMP], capture_output=True, check=True,
                         env={**os.environ, "TORCH_FR_BUFFER_SIZE": "16"}).stdout
    (tmp_path / "fr_trace_rank_0").write_bytes(raw)
    (dump0,) = load_dumps(str(tmp_path)).values()
    assert "all_reduce" in dump0["entries"][-1]["profiling_name"]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "nccl_trace_rank_0").write_bytes(pickle.dumps(
        {"entries": [], "payload": _Exploit(marker)}))
    out = subprocess.run([sys.executable, "-m", "llmtrain", "analyze", str(dumps)],
                         capture_output=True, text=True)
    assert not marker.exists()
    assert out.returncode == 1 and "refused" in out.stderr and "posix.system" in out.stderr


# NCCL's dumps, as ProcessGroupNCCL writes them (format 2.10): entries record when the
# stream started and completed each collective; pg_config lists each group's ranks.
T0 = 1_750_000_000 * 10**9


def nccl_entry(seq: int, state: str = "completed", op: str = "nccl:all_reduce",
               sizes=((1024,),), dtype: str = "BFloat16", pg=("0", "default_pg"),
               pg_id: int = 0, at_s: float | None = None, started_after_s: float = 0.001,
               timeout_ms: int = 30_000) -> dict:
    created = T0 + int((seq if at_s is None else at_s) * 1e9)
    started = None if state == "scheduled" else created + int(started_after_s * 1e9)
    return {"record_id": seq, "pg_id": pg_id, "process_group": pg, "thread_name": "pt_main",
            "thread_id": "1", "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": op, "time_created_ns": created,
            "input_sizes": [list(s) for s in sizes], "input_dtypes": [dtype] * len(sizes),
            "output_sizes": [list(s) for s in sizes], "output_dtypes": [dtype] * len(sizes),
            "state": state, "time_discovered_started_ns": started,
            "time_discovered_completed_ns": started + 10**6 if state == "completed" else None,
            "retired": state == "completed", "timeout_ms": timeout_ms, "is_p2p": False,
            "frames": [{"name": "train_step", "filename": "train.py", "line": 42}]}


def nccl_dump(entries: list[dict], groups=(("0", "default_pg", range(4)),)) -> dict:
    status = {}
    for e in entries:
        s = status.setdefault(str(e["pg_id"]), {"last_enqueued_collective": -1,
                                                "last_started_collective": -1,
                                                "last_completed_collective": -1})
        s["last_enqueued_collective"] = max(s["last_enqueued_collective"], e["collective_seq_id"])
        for key, states in (("last_started_collective", ("started", "completed")),
                            ("last_completed_collective", ("completed",))):
            if e["state"] in states:
                s[key] = max(s[key], e["collective_seq_id"])
    return {"version": "2.10", "comm_lib_version": "2.21.5",
            "pg_config": {name: {"name": name, "desc": desc, "ranks": str(list(ranks))}
                          for name, desc, ranks in groups},
            "pg_status": status, "entries": entries, "nccl_comm_state": {}}


def write_nccl(tmp_path, dumps: dict[int, dict], as_json: bool = False):
    """One file a rank, named as TORCH_FR_DUMP_TEMP_FILE's default prefix names them."""
    for rank, d in dumps.items():
        if as_json:  # _dump_fr_trace_json: strings for pg_status, 0 for times not seen
            d = {**d, "pg_status": {k: {n: str(v) for n, v in s.items()}
                                    for k, s in d["pg_status"].items()},
                 "entries": [{**e, "time_discovered_started_ns":
                              e["time_discovered_started_ns"] or 0,
                              "time_discovered_completed_ns":
                              e["time_discovered_completed_ns"] or 0} for e in d["entries"]]}
            (tmp_path / f"nccl_trace_rank_{rank}.json").write_text(json.dumps(d))
        else:
            (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(d))
    return analyze(load_dumps(str(tmp_path)))


def done(*seqs, **kw) -> list[dict]:
    return [nccl_entry(s, **kw) for s in seqs]


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("rank2, kind", [
    (done(1, 2, 3, 4, 5), "never_arrived"),
    (done(1, 2, 3, 4, 5) + [nccl_entry(6, "scheduled")], "not_started"),
])
def test_nccl_hang_blames_the_rank_not_in_the_first_started_collective(tmp_path, rank2, kind,
                                                                       as_json):
    """Ranks 0, 1 and 3 started #6 (and queued #7 behind it); rank 2 did not start it."""
    waiting = done(1, 2, 3, 4, 5) + [nccl_entry(6, "started"), nccl_entry(7, "scheduled")]
    r = write_nccl(tmp_path, {0: nccl_dump(waiting), 1: nccl_dump(waiting),
                              2: nccl_dump(rank2), 3: nccl_dump(waiting)}, as_json)
    assert r.culprits == [2] and r.stuck == [0, 1, 3] and r.missing_dumps == []
    assert r.collective["seq"] == 6 and r.collective["pg"] == "default_pg"
    assert [(f.kind, f.seq, f.ranks) for f in r.findings if f.ranks] == [(kind, 6, [2])]
    assert "nccl:all_reduce #6 on process group default_pg" in r.verdict


@pytest.mark.parametrize("odd, kind", [
    ({"op": "nccl:all_gather"}, "op_mismatch"),
    ({"sizes": ((2048,),)}, "size_mismatch"),
    ({"dtype": "Float"}, "dtype_mismatch"),
])
def test_nccl_desync_early_in_the_run_is_named(tmp_path, odd, kind):
    """A desync at #3 that NCCL ran through (wrong results, no error) before the job hung
    at #6: the culprit is rank 1 at #3, not the hang's last collective."""
    dumps = {r: nccl_dump(done(1, 2) + [nccl_entry(3, **(odd if r == 1 else {}))]
                          + done(4, 5) + [nccl_entry(6, "started")]) for r in range(4)}
    r = write_nccl(tmp_path, dumps)
    assert r.culprits == [1] and r.stuck == [0, 2, 3]
    assert r.collective == {"pg": "default_pg", "seq": 3, "op": "nccl:all_reduce",
                            "sizes": [[1024]], "dtypes": ["BFloat16"]}
    (desync,) = [f for f in r.findings if f.kind.endswith("_mismatch")]
    assert (desync.kind, desync.seq, desync.ranks) == (kind, 3, [1])
    assert r.verdict.startswith("desync at nccl:all_reduce #3 on process group default_pg")


@pytest.mark.parametrize("late", [{"at_s": 6 + 45}, {"started_after_s": 45}])
def test_nccl_rank_later_than_the_timeout_is_named(tmp_path, late):
    """Rank 3 reached #6 45 s after the others (on the host, or on its stream), past
    their 30 s timeout: they had timed out waiting for it."""
    dumps = {r: nccl_dump(done(1, 2, 3, 4, 5) + [nccl_entry(6, "started",
                                                            **(late if r == 3 else {}))])
             for r in range(4)}
    r = write_nccl(tmp_path, dumps)
    assert r.culprits == [3] and r.stuck == [0, 1, 2] and r.collective["seq"] == 6
    (found,) = [f for f in r.findings if f.ranks]
    assert (found.kind, found.seq, found.ranks) == ("late", 6, [3])
    assert "45.0 s after rank 0, past its 30 s timeout" in r.verdict


def test_nccl_group_members_and_a_missing_rank_come_from_pg_config(tmp_path):
    """Rank 3 left no dump and --world-size is not given: pg_config says the world is 0-3
    and group tp is 2-3, where rank 2 waits in #4; ranks 0 and 1 are not tp's."""
    groups = (("0", "default_pg", range(4)), ("1", "tp", (2, 3)))
    tp = dict(pg=("1", "tp"), pg_id=1)
    base = done(1, 2, 3, 4, 5)
    r = write_nccl(tmp_path, {0: nccl_dump(base, groups), 1: nccl_dump(base, groups),
                              2: nccl_dump(base + done(1, 2, 3, **tp)
                                           + [nccl_entry(4, "started", **tp)], groups)})
    assert r.missing_dumps == [3] and r.culprits == [3] and r.stuck == [2]
    assert r.collective["pg"] == "tp" and r.collective["seq"] == 4
    assert r.groups["tp"]["members"] == [2, 3] and r.groups["tp"]["known_from"] == "pg_config"
    assert r.verdict.startswith("rank(s) [3] never reached nccl:all_reduce #4 on process "
                                "group tp")
    # on the default group everyone completed #5: rank 3 took part, then stopped
    (default,) = [f for f in r.findings if f.kind == "missing" and f.pg == "default_pg"]
    assert default.seq == 5 and "took part" in default.text


def test_nccl_progress_from_pg_status_without_entries(tmp_path):
    """Dumps of active entries only (onlyActive): rank 2 has none, but its pg_status says
    it completed #5, so it never reached #6, where the others wait."""
    waiting = nccl_dump([nccl_entry(6, "started")])
    idle = {**nccl_dump([]), "pg_status": {"0": {"last_enqueued_collective": 5,
                                                 "last_started_collective": 5,
                                                 "last_completed_collective": 5}}}
    del idle["entries"]  # PyTorch leaves the key out when there is nothing to list
    r = write_nccl(tmp_path, {0: waiting, 1: waiting, 2: idle, 3: waiting})
    assert r.culprits == [2] and r.stuck == [0, 1, 3]
    (never,) = [f for f in r.findings if f.kind == "never_arrived"]
    assert never.seq == 6 and "its last collective there is #5" in never.text


def test_what_gloo_dumps_cannot_tell_is_said(tmp_path):
    """gloo lists no ranks once a subgroup exists and records no completion: the report
    says what it cannot tell and why, instead of guessing."""
    gloo = [entry(1), {**entry(2, done=False), "pg_id": 0}]
    dumps = {r: {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
                 "entries": gloo if r else [entry(1), entry(2)]} for r in range(2)}
    r = analyze(dumps)
    cannot = " ".join(f.text for f in r.findings if f.kind == "cannot_tell")
    assert "whether ranks above 1 are missing cannot be told" in cannot
    assert "whether gloo:all_reduce #2" in cannot and "completed cannot be told" in cannot
    assert "reduce op" in cannot
    assert r.culprits == [] and r.verdict.startswith("no fault found in the collectives")


@pytest.mark.parametrize("rank2_freed", [True, False])
def test_a_rank_that_went_on_to_another_group_has_left_a_collective_gloo_kept_open(rank2_freed):
    """TP pairs [0, 1] and [2, 3], DP pairs [0, 2] and [1, 3]; rank 0 stopped before tp_a #2
    (no dump). tp_b #2 ended on ranks 2 and 3, but rank 3 (and maybe rank 2) still held its
    work object when it dumped (gloo then keeps it unretired), and rank 3 went on to dp_b
    #2. The verdict is rank 0 in tp_a #2 (dumps of the test suite's planted job, whose
    verdict blamed tp_b #2 when its entry there was the earlier one)."""
    def at(seq, pg, ns, done=True):
        return {**entry(seq, sizes=((4,),), pg=pg, done=done), "time_created_ns": ns}
    tp_a, tp_b, dp_a, dp_b = ("1", "tp_a"), ("2", "tp_b"), ("3", "dp_a"), ("4", "dp_b")
    dumps = {1: dump(1, at(1, tp_a, 295), at(1, dp_b, 297), at(2, tp_a, 301, done=False)),
             2: dump(2, at(1, tp_b, 287), at(1, dp_a, 295), at(2, tp_b, 296, done=rank2_freed)),
             3: dump(3, at(1, tp_b, 293), at(1, dp_b, 296), at(2, tp_b, 298, done=False),
                     at(2, dp_b, 303, done=False))}
    r = analyze(dumps, world_size=4)
    assert r.verdict.startswith("rank(s) [0] never reached gloo:all_reduce #2 on process "
                                "group tp_a"), r.verdict
    assert r.culprits == [0] and r.stuck == [1]


def test_a_write_begun_after_a_rank_blocked_does_not_make_it_a_culprit():
    """TP pairs [0, 1] and [2, 3], DP pairs [0, 2] and [1, 3]; rank 0 stopped (no dump)
    while rank 1 waits for it in tp_a #2, so rank 1 never reaches dp_b #2, where rank 3
    waits. A checkpoint's write then ran a collective of its own on every live rank, off
    the training thread (gloo marked it ended): on rank 1 newer than tp_a #2, which made
    that collective look left and rank 1 a culprit (seen in a chaos run: the stopped rank's TP peer was evicted
    with it, and the job went cold). Rank 0 alone is to blame, rank 1 is blocked."""
    def at(seq, pg, ns, done=True):
        return {**entry(seq, sizes=((4,),), pg=pg, done=done), "time_created_ns": ns}
    tp_a, tp_b, dp_a, dp_b = ("1", "tp_a"), ("2", "tp_b"), ("3", "dp_a"), ("4", "dp_b")
    io = ("5", f"{OFF_THREAD}checkpoint_io")
    dumps = {1: dump(1, at(1, tp_a, 100), at(1, dp_b, 110), at(2, tp_a, 300, done=False),
                     at(1, io, 310)),
             2: dump(2, at(1, tp_b, 100), at(1, dp_a, 110), at(2, tp_b, 200),
                     at(2, dp_a, 305, done=False), at(1, io, 310)),
             3: dump(3, at(1, tp_b, 100), at(1, dp_b, 110), at(2, tp_b, 200),
                     at(2, dp_b, 305, done=False), at(1, io, 310))}
    r = analyze(dumps, world_size=4)
    assert r.culprits == [0], r.verdict
    assert any(f.kind == "blocked" and f.waiting == [1] for f in r.findings), r.details


def test_a_rank_left_inside_a_collective_others_completed_waits_for_the_stopped_member():
    """TP pairs [0, 1] and [2, 3], DP pairs [0, 2] and [1, 3]; rank 0 stopped (no dump)
    midway through the world's all-reduce #9, after ranks 1 and 2 had what they needed
    from it: they completed it and went on to their TP all-reduce #169, where rank 2 waits
    for rank 3; rank 3 still waits in #9 (its stack is in the call) for rank 0's part.
    Rank 0 alone is to blame: rank 3 is blocked, not a rank that never arrived (seen in a
    chaos run: rank 3 was evicted with rank 0 and the job went cold)."""
    def at(seq, pg, ns, done=True):
        return {**entry(seq, sizes=((4,),), pg=pg, done=done), "time_created_ns": ns}
    tp_a, tp_b, world = ("7", "mesh_tp"), ("8", "mesh_tp"), ("0", "default_pg")
    waiting = ('  File "/venv/lib/python3.11/site-packages/torch/distributed/'
               'distributed_c10d.py", line 3252, in all_reduce\n    work.wait()\n')
    dumps = {1: dump(1, at(168, tp_a, 100), at(9, world, 150), at(169, tp_a, 200, done=False)),
             2: dump(2, at(168, tp_b, 100), at(9, world, 150), at(169, tp_b, 200, done=False)),
             3: dump(3, at(168, tp_b, 100), at(9, world, 150, done=False), stack=waiting)}
    r = analyze(dumps, world_size=4)
    assert r.culprits == [0], r.verdict
    assert any(f.kind == "blocked" and 3 in f.waiting for f in r.findings), r.details
    assert r.verdict.startswith("rank(s) [3] wait in gloo:all_reduce #9 on process group "
                                "default_pg"), r.verdict
    assert "which rank(s) [1, 2] completed: rank(s) [0] (no dump) stopped" in r.verdict
    # the same dumps without the stack: rank 3 may only hold its finished work object, as
    # gloo leaves it unretired until freed, and it is blamed for #169 as before
    computing = {**dumps, 3: dump(3, at(168, tp_b, 100), at(9, world, 150, done=False))}
    assert analyze(computing, world_size=4).culprits == [0, 3]
