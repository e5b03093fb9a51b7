"""Flight-recorder dumps in, a verdict out: which rank is stuck where, and who is to blame.

Input: one dump per rank, either llmtrain's (``rank-00003.json``: the recorder's entries
plus the rank's Python stacks and progress) or PyTorch's own pickled dumps (as written by
``TORCH_FR_DUMP_TEMP_FILE`` on NCCL timeouts). Both carry the recorder's entries: per
process group, collectives numbered by ``collective_seq_id`` with op, sizes, dtypes and
whether they completed (``retired``).

The cross-rank rules, per process group:
1. the collective the job is stuck in is the highest sequence number any rank entered
   without completing it;
2. ranks whose last collective is older never arrived: they are the culprits (their
   Python stack says where they are instead);
3. if every rank arrived, ranks that called it with another op, sizes or dtypes than the
   majority are the culprits (a desync);
4. ranks expected but without a dump (killed, or stopped so hard their watchdog could not
   answer) are named as the likely culprits.

With ``reliability.desync_debug`` PyTorch checks each collective's op, shape and dtype
across ranks before running it and raises naming two ranks' fingerprints; the ranks'
errors together give the majority and so the odd rank out.
"""

from __future__ import annotations

import io
import json
import pickle
import posixpath
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec

from llmtrain.fsio import join, write_atomic


@dataclass
class Collective:
    pg: str
    seq: int
    op: str
    sizes: list
    dtypes: list
    completed: bool

    @classmethod
    def from_entry(cls, e: dict[str, Any]) -> "Collective":
        pg = e.get("process_group") or [str(e.get("pg_id", "?")), ""]
        name = pg[1] if len(pg) > 1 and pg[1] not in ("", "undefined") else f"pg {pg[0]}"
        return cls(pg=name, seq=int(e["collective_seq_id"]), op=e["profiling_name"],
                   sizes=e.get("input_sizes", []), dtypes=e.get("input_dtypes", []),
                   completed=bool(e.get("retired")) or e.get("state") == "completed")

    def signature(self) -> str:
        return f"{self.op} sizes={self.sizes} dtypes={self.dtypes}"


@dataclass
class Report:
    verdict: str
    culprits: list[int]
    stuck: list[int]
    collective: dict[str, Any] | None
    missing_dumps: list[int]
    details: list[str] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self, title: str = "Diagnosis") -> str:
        lines = [f"# {title}", "", f"**{self.verdict}**", ""]
        if self.collective:
            c = self.collective
            lines += [f"- collective: `{c['op']}` #{c['seq']} on process group `{c['pg']}`, "
                      f"sizes {c['sizes']}, dtypes {c['dtypes']}"]
        lines += [f"- culprit rank(s): {self.culprits or 'none identified'}",
                  f"- ranks waiting in the collective: {self.stuck}",
                  f"- ranks without a dump: {self.missing_dumps or 'none'}", ""]
        lines += [f"- {d}" for d in self.details]
        for rank, stack in sorted(self.stacks.items()):
            lines += ["", f"## Python stack of rank {rank}", "", "```", stack.rstrip(), "```"]
        return "\n".join(lines) + "\n"


def _collectives(dump: dict[str, Any]) -> dict[str, list[Collective]]:
    by_pg: dict[str, list[Collective]] = {}
    for e in dump.get("entries", []):
        if e.get("is_p2p"):
            continue
        c = Collective.from_entry(e)
        by_pg.setdefault(c.pg, []).append(c)
    for cs in by_pg.values():
        cs.sort(key=lambda c: c.seq)
    return by_pg


# PyTorch's desync check (TORCH_DISTRIBUTED_DEBUG=DETAIL) names two ranks' fingerprints.
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=(\d+), OpType=(\w+), TensorShape=\[([^\]]*)\], "
                          r"TensorDtypes=(\w+)")


def _checked_desync(dumps: dict[int, dict[str, Any]], missing: list[int],
                    stacks: dict[int, str]) -> Report | None:
    """The verdict from PyTorch's own desync errors, when ranks died of one."""
    seen: dict[int, tuple] = {}
    for d in dumps.values():
        for rank, seq, op, shape, dtype in _FINGERPRINT.findall(d.get("error") or ""):
            seen[int(rank)] = (int(seq), op, f"[{shape}]", dtype)
    if len(set(seen.values())) < 2:
        return None
    majority, _ = Counter(seen.values()).most_common(1)[0]
    odd = sorted(r for r, f in seen.items() if f != majority)
    seq, op, shape, dtype = majority
    show = lambda f: f"{f[1]} shape {f[2]} {f[3]}"  # noqa: E731
    verdict = (f"desync at collective #{seq}: rank(s) {odd} called "
               f"{', '.join(show(seen[r]) for r in odd)}, the others {show(majority)} "
               f"(caught by the desync check before it ran)")
    return Report(verdict, culprits=odd, stuck=sorted(r for r in seen if r not in odd),
                  collective={"pg": "?", "seq": seq, "op": op, "sizes": [shape],
                              "dtypes": [dtype]},
                  missing_dumps=missing, stacks={r: s for r, s in stacks.items() if r in odd})


def analyze(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> Report:
    """The verdict over ``dumps`` (rank -> dump); ``world_size`` names missing ranks."""
    ranks = sorted(dumps)
    expected = range(world_size) if world_size else ranks
    missing = [r for r in expected if r not in dumps]
    per_rank = {r: _collectives(d) for r, d in dumps.items()}
    stacks = {r: d["stacks"]["MainThread"] for r, d in dumps.items()
              if "MainThread" in d.get("stacks", {})}
    checked = _checked_desync(dumps, missing, stacks)
    if checked:
        return checked

    # The process group with an uncompleted collective at the highest sequence number.
    stuck_at: tuple[str, int] | None = None
    for r in ranks:
        for pg, cs in per_rank[r].items():
            for c in cs:
                if not c.completed and (stuck_at is None or (pg, c.seq) > stuck_at):
                    stuck_at = (pg, c.seq)
    if stuck_at is None:
        verdict = "no rank is inside an unfinished collective"
        if missing:
            verdict += f"; rank(s) {missing} did not dump (dead or stopped): likely culprit(s)"
        return Report(verdict, culprits=missing, stuck=[], collective=None,
                      missing_dumps=missing, stacks=stacks)

    pg, seq = stuck_at
    arrived = {r: next((c for c in per_rank[r].get(pg, []) if c.seq == seq), None)
               for r in ranks}
    there = {r: c for r, c in arrived.items() if c is not None}
    behind = sorted(r for r, c in arrived.items() if c is None)
    majority, _ = Counter(c.signature() for c in there.values()).most_common(1)[0]
    ref = next(c for c in there.values() if c.signature() == majority)
    collective = {"pg": pg, "seq": seq, "op": ref.op, "sizes": ref.sizes, "dtypes": ref.dtypes}
    details = []
    for r in behind:
        last = per_rank[r].get(pg, [])
        where = f"its last collective there is #{last[-1].seq} ({last[-1].op})" if last else \
            "it recorded no collective there"
        details.append(f"rank {r} never arrived at {ref.op} #{seq} on {pg}: {where}")
    counts = Counter(c.signature() for c in there.values()).most_common()
    # No majority (two ranks, or an even split): which side is wrong cannot be told, so
    # every rank of the split is named, and the verdict says so.
    tie = len(counts) > 1 and counts[0][1] == counts[1][1]
    odd = sorted(r for r, c in there.items() if tie or c.signature() != majority)
    for r in ([] if tie else odd):
        details.append(f"rank {r} called {there[r].signature()} as #{seq} on {pg}, "
                       f"the others {majority}")
    for r in missing:
        details.append(f"rank {r} wrote no dump: killed, or stopped (e.g. SIGSTOP) so that "
                       f"even its watchdog could not answer")

    culprits = sorted(set(behind) | set(odd) | set(missing))
    stuck = sorted(r for r in there if r not in odd)
    what = f"{ref.op} #{seq} on process group {pg} (sizes {ref.sizes}, dtypes {ref.dtypes})"
    if tie:
        sides = ", ".join(f"rank {r} called {there[r].signature()}" for r in odd)
        verdict = (f"desync at collective #{seq} on process group {pg}, with no majority to "
                   f"tell the odd rank out: {sides}")
        details.append(f"{sides}; with more ranks the odd one out would be named")
    elif odd:
        verdict = (f"desync at {what}: rank(s) {odd} called a different collective "
                   f"({', '.join(there[r].signature() for r in odd)})")
    elif behind or missing:
        verdict = (f"rank(s) {sorted(set(behind) | set(missing))} never reached {what}; "
                   f"rank(s) {stuck} wait in it")
    else:
        verdict = f"every rank is inside {what} and none completed it (network or peer failure)"
    return Report(verdict, culprits=culprits, stuck=stuck, collective=collective,
                  missing_dumps=missing, details=details,
                  stacks={r: s for r, s in stacks.items() if r in culprits or r in stuck[:1]})


class _Refused(pickle.UnpicklingError):
    pass


class _DataOnly(pickle.Unpickler):
    """PyTorch's flight-recorder pickles hold only dicts, lists, strings and numbers. A
    pickle that names any class or function (the way a pickle runs code) is refused, so
    analyzing someone else's dumps cannot run their code."""

    def find_class(self, module: str, name: str):
        raise _Refused(f"it asks for {module}.{name}; flight-recorder dumps hold plain data only")


_RANK_IN_NAME = re.compile(r"(\d+)(?:\.json)?$")


def load_dumps(url: str) -> dict[int, dict[str, Any]]:
    """Every dump in the directory ``url``: llmtrain's JSON ones, or PyTorch's pickled
    flight-recorder files (rank taken from the dump, else from the file name's end)."""
    fs, root = fsspec.core.url_to_fs(url)
    dumps = {}
    for path in sorted(fs.ls(root, detail=False)):
        name = posixpath.basename(path)
        if name.startswith("report") or name.endswith(".md"):
            continue
        raw = fs.cat_file(path)
        try:
            dump = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            try:
                dump = _DataOnly(io.BytesIO(raw)).load()  # PyTorch's own format
            except _Refused as e:
                print(f"llmtrain: refused {path}: {e}", file=sys.stderr)
                continue
            except Exception:  # noqa: BLE001 - not a dump at all
                continue
        if not isinstance(dump, dict) or "entries" not in dump:
            continue
        rank = dump.get("rank")
        if rank is None:
            match = _RANK_IN_NAME.search(name)
            if not match:
                continue
            rank = int(match.group(1))
        dumps[int(rank)] = dump
    return dumps


def write_report(url: str, report: Report, extra: dict[str, Any]) -> None:
    write_atomic(join(url, "report.json"),
                 json.dumps({**extra, **report.to_json()}, indent=1).encode())
    write_atomic(join(url, "report.md"), report.to_markdown(
        f"Diagnosis: {extra.get('event', '')}").encode())
