import json
import os
import pickle
import subprocess
import sys

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
