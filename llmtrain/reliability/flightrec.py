"""Flight-recorder dumps in, a verdict out: which rank is stuck where, and who is to blame.

Input: one dump per rank of any PyTorch job, gloo or NCCL, recorder format 2.x: llmtrain's
(``rank-00003.json``: the recorder plus the rank's Python stacks and progress), PyTorch's
pickles (``_dump_fr_trace``; NCCL's dump on a timeout, named ``<TORCH_FR_DUMP_TEMP_FILE
prefix><rank>``) or its JSON (``_dump_fr_trace_json``). Each holds the recorder's entries
(per process group, collectives numbered by ``collective_seq_id``, with op, sizes, dtypes,
when the rank entered them and, where the backend records it, when they started and
completed), ``pg_config`` (each group's ranks) and ``pg_status`` (each group's progress).

The cross-rank rules, per process group (its members from ``pg_config``; the default
group's are the world, so a missing dump is noticed without being told the world size):
1. ranks that called a collective with another op, sizes or dtypes than the majority, at
   any sequence number, are the culprits (a desync);
2. the collective the group is stuck in is, on NCCL, the first one started and not
   completed, and on gloo (which records neither) the newest one any member entered;
   members that never entered it, queued it without starting it (NCCL: their stream is
   busy), or left no dump (killed, or stopped so hard they could not answer) are the
   culprits; their newest collective elsewhere says where they are instead;
3. a rank that entered a collective more than the first rank's timeout after it is the
   culprit: the others had given up waiting for it.
What the dumps cannot settle (whether gloo work completed or failed, a world no
``pg_config`` lists, reduce ops, which the recorder does not keep) is said, with why.

With ``reliability.desync_debug`` PyTorch checks each collective's op, shape and dtype
across ranks before running it and raises naming two ranks' fingerprints; the ranks'
errors together give the majority and so the odd rank out.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import posixpath
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec

from llmtrain.distributed.group_names import OFF_THREAD, group_label
from llmtrain.fsio import join, write_atomic

log = logging.getLogger(__name__)


@dataclass
class Collective:
    """One rank's record of one collective."""
    group: str  # the process group's name: the same on every rank
    desc: str
    seq: int
    op: str
    sizes: list
    dtypes: list
    out_sizes: list
    out_dtypes: list
    state: str
    retired: bool
    created_ns: int
    started_ns: int  # 0: not recorded
    completed_ns: int  # 0: not recorded (gloo never records it)
    timeout_ms: int

    @classmethod
    def from_entry(cls, e: dict[str, Any]) -> "Collective":
        pg = list(e.get("process_group") or [str(e.get("pg_id", 0)), ""])
        return cls(group=str(pg[0]), desc=pg[1] if len(pg) > 1 else "",
                   seq=int(e["collective_seq_id"]), op=e["profiling_name"],
                   sizes=e.get("input_sizes", []), dtypes=e.get("input_dtypes", []),
                   out_sizes=e.get("output_sizes", []), out_dtypes=e.get("output_dtypes", []),
                   state=e.get("state", "scheduled"), retired=bool(e.get("retired")),
                   created_ns=int(e.get("time_created_ns") or 0),
                   started_ns=int(e.get("time_discovered_started_ns") or 0),
                   completed_ns=int(e.get("time_discovered_completed_ns") or 0),
                   timeout_ms=int(e.get("timeout_ms") or 0))

    @property
    def gloo(self) -> bool:
        """gloo records no start or completion: ``state`` stays scheduled, and ``retired``
        is set once the work has ended, completed or failed alike, and some time after."""
        return self.op.startswith("gloo:")

    @property
    def inside(self) -> bool:
        """The rank was still in it when it dumped, as far as its recorder knows."""
        return not self.retired if self.gloo else self.state != "completed"

    def shape(self) -> tuple[str, str, str]:
        """What every rank must agree on (op, sizes, dtypes): rooted and uneven collectives
        differ by rank in the list only a root holds, or in their splits."""
        kind = self.op.rpartition(":")[2]
        if "to_all" in kind or "alltoall" in kind:
            sizes, dtypes = (), (self.dtypes, self.out_dtypes)
        elif kind == "gather":
            sizes, dtypes = self.sizes, self.dtypes
        elif kind == "scatter":
            sizes, dtypes = self.out_sizes, self.out_dtypes
        else:
            sizes, dtypes = (self.sizes, self.out_sizes), (self.dtypes, self.out_dtypes)
        return self.op, repr(sizes), repr(dtypes)

    def signature(self) -> str:
        return f"{self.op} sizes={self.sizes} dtypes={self.dtypes}"


@dataclass
class Finding:
    """One thing the dumps show (or cannot show): ``kind`` is op_mismatch, size_mismatch,
    dtype_mismatch, never_arrived, not_started, missing, late, unfinished, blocked or
    cannot_tell."""
    kind: str
    text: str
    pg: str | None = None
    seq: int | None = None
    ranks: list[int] = field(default_factory=list)  # to blame
    waiting: list[int] = field(default_factory=list)  # inside the collective, waiting


@dataclass
class Report:
    """The verdict and what the watchdog's event carries (culprits, collective), and every
    finding; ``details`` are the findings' texts."""
    verdict: str
    culprits: list[int]
    stuck: list[int]
    collective: dict[str, Any] | None
    missing_dumps: list[int]
    details: list[str] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)

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
        lines += [f"- {f.kind}: {f.text}" for f in self.findings]
        if self.groups:
            lines += ["", "## Process groups", ""]
            lines += [f"- `{label}`: ranks {g['members']} (from {g['known_from']}); newest "
                      f"collective per rank: {g['last']}" for label, g in self.groups.items()]
        for rank, stack in sorted(self.stacks.items()):
            lines += ["", f"## Python stack of rank {rank}", "", "```", stack.rstrip(), "```"]
        return "\n".join(lines) + "\n"


# The default group's name where no entry shows it. gloo records each group's ranks under
# "" (before the group has its name), a subgroup's as [] (before it has its ranks): so a
# non-empty "" lists the world.
_DEFAULT, _UNNAMED = "0", ""
_FAULTS = ("op_mismatch", "size_mismatch", "dtype_mismatch", "never_arrived", "not_started",
           "missing", "late")
_CALLED = {"op": "a different collective", "size": "it with other sizes",
           "dtype": "it with another dtype"}


def _gone(ranks: list[int]) -> str:
    return (f"rank(s) {ranks} wrote no dump: killed, or stopped (e.g. SIGSTOP) so that even "
            f"a watchdog could not answer")


def _difference(a: tuple, b: tuple) -> str:
    """What two (op, sizes, dtypes) fingerprints differ in first."""
    return "op" if a[0] != b[0] else "dtype" if a[2] != b[2] else "size"


@dataclass
class _Head:
    """A group's diagnosis for the verdict: its most telling finding, as a sentence."""
    priority: int  # 1 a desync, 2 a rank that others wait or waited for, 3 nobody waiting
    sentence: str
    ranks: list[int]
    waiting: list[int]
    collective: dict[str, Any] | None
    since_ns: int  # when the collective began: the earliest stuck group is likely the cause


@dataclass
class _Group:
    name: str
    label: str
    calls: dict[int, dict[int, Collective]] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)  # newest seq each rank entered
    members: list[int] = field(default_factory=list)
    known_from: str = "the dumps"

    def _at(self, seq: int, ranks) -> dict[int, Collective]:
        return {r: self.calls[r][seq] for r in ranks if seq in self.calls.get(r, {})}

    def _seqs(self, ranks) -> list[int]:
        return sorted({s for r in ranks for s in self.calls.get(r, {})})

    def what(self, c: Collective) -> str:
        return f"{c.op} #{c.seq} on process group {self.label} (sizes {c.sizes}, dtypes {c.dtypes})"

    def collective(self, c: Collective) -> dict[str, Any]:
        return {"pg": self.label, "seq": c.seq, "op": c.op, "sizes": c.sizes, "dtypes": c.dtypes}

    def desync(self, ranks: list[int]) -> tuple[list[Finding], _Head | None]:
        """Rule 1, at the first sequence number where the ranks disagree."""
        wrong = [s for s in self._seqs(ranks)
                 if len({c.shape() for c in self._at(s, ranks).values()}) > 1]
        if not wrong:
            return [], None
        calls = self._at(wrong[0], ranks)
        counts = Counter(c.shape() for c in calls.values()).most_common()
        # No majority (two ranks, or an even split): which side is wrong cannot be told, so
        # every rank of the split is named, and the verdict says so.
        tie = counts[0][1] == counts[1][1]
        ref = next(c for c in calls.values() if c.shape() == counts[0][0])
        odd = sorted(r for r, c in calls.items() if tie or c.shape() != ref.shape())
        diff = _difference(counts[0][0], counts[1][0])
        seq, sides = ref.seq, ", ".join(f"rank {r} called {calls[r].signature()}" for r in odd)
        if tie:
            sentence = (f"desync at collective #{seq} on process group {self.label}, with no "
                        f"majority to tell the odd rank out: {sides}")
            text = f"{sides}; with more ranks the odd one out would be named"
        else:
            sentence = (f"desync at {self.what(ref)}: rank(s) {odd} called {_CALLED[diff]} "
                        f"({', '.join(calls[r].signature() for r in odd)})")
            text = "; ".join(f"rank {r} called {calls[r].signature()} as #{seq} on "
                             f"{self.label}, the others {ref.signature()}" for r in odd)
        if len(wrong) > 1:
            text += f"; {len(wrong) - 1} later collective(s) there disagree too, in its wake"
        waiting = sorted(set(calls) - set(odd))
        return ([Finding(f"{diff}_mismatch", text, self.label, seq, odd, waiting)],
                _Head(1, sentence, odd, waiting, self.collective(ref), ref.created_ns))

    def late(self, ranks: list[int]) -> tuple[list[Finding], _Head | None]:
        """Rule 3, at the first sequence number a rank came too late to. A rank arrives when
        it enters the collective or, where that is recorded, when its stream starts it."""
        for seq in self._seqs(ranks):
            arrived = {r: max(c.created_ns, c.started_ns)
                       for r, c in self._at(seq, ranks).items() if c.created_ns}
            if len(arrived) < 2:
                continue
            first = min(arrived, key=arrived.get)
            ref = self.calls[first][seq]
            late = sorted(r for r, t in arrived.items()
                          if ref.timeout_ms and t - arrived[first] > ref.timeout_ms * 1e6)
            if not late:
                continue
            lag = {r: (arrived[r] - arrived[first]) / 1e9 for r in late}
            waiting = sorted(set(arrived) - set(late))
            sentence = (f"rank(s) {late} reached {self.what(ref)} {max(lag.values()):.1f} s "
                        f"after rank {first}, past its {ref.timeout_ms / 1000:g} s timeout: "
                        f"rank(s) {waiting} had given up waiting")
            text = "; ".join(f"rank {r} reached {ref.op} #{seq} on {self.label} {lag[r]:.1f} s "
                             f"after rank {first} (timeout {ref.timeout_ms / 1000:g} s)"
                             for r in late)
            return ([Finding("late", text, self.label, seq, late, waiting)],
                    _Head(2, sentence, late, waiting, self.collective(ref), arrived[first]))
        return [], None

    def stuck(self, ranks: list[int], dumped: set[int],
              newest: dict[int, tuple[str, Collective]], calling: frozenset[int] = frozenset()
              ) -> tuple[list[Finding], _Head | None]:
        """Rule 2: the collective the group is stuck in, and who is not in it. ``calling``:
        the ranks whose training thread's stack is inside a torch.distributed call."""
        live = [r for r in ranks if r in dumped]
        recorded = [c for r in live for c in self.calls.get(r, {}).values() if not c.gloo]
        started = [c.seq for c in recorded if c.state == "started"]
        pending = [c.seq for c in recorded if c.inside]
        seq = min(started or pending or [max([self.last.get(r, 0) for r in live] or [0])])
        records = self._at(seq, live)
        if not records:
            return [], None  # no collective, or the recorders were overwritten past it
        top = Counter(c.signature() for c in records.values()).most_common(1)[0][0]
        ref = next(c for c in records.values() if c.signature() == top)
        what = self.what(ref)
        # Queued behind earlier work on its stream, while others started it (NCCL).
        queued = sorted(r for r, c in records.items() if not c.gloo and c.state == "scheduled"
                        and any(o.state != "scheduled" for o in records.values()))
        never = sorted(r for r in live if self.last.get(r, 0) < seq)
        entered = sorted(set(live) - set(queued) - set(never))
        # a rank that went on past it shows it ended: then every member had come, and a
        # rank gloo still shows inside only holds its work object; unless its stack is in
        # a collective's call and it went nowhere since: gloo ends a collective on each rank
        # once that rank has what it needs, and a member stopped midway leaves the others
        # that still wait for its part inside
        done = [r for r, c in records.items() if r in entered and self._left(r, c, newest)]
        inside = [r for r in entered if r in records and records[r].inside and r not in done
                  and (not done or r in calling)]
        missing = sorted(set(ranks) - dumped)
        if done and inside and missing:
            text = (f"{_gone(missing)}; rank(s) {sorted(done)} completed {what} and went on, "
                    f"rank(s) {inside} wait in it: rank(s) {missing} stopped before their "
                    f"part of it was done")
            return [Finding("missing", text, self.label, seq, missing, inside)], _Head(
                2, f"rank(s) {inside} wait in {what}, which rank(s) {sorted(done)} completed: "
                   f"rank(s) {missing} (no dump) stopped before their part of it was done",
                missing, inside, self.collective(ref), ref.created_ns)
        findings = [Finding("never_arrived", f"rank {r} never arrived at {ref.op} #{seq} on "
                            f"{self.label}: {self._whereabouts(r, newest)}", self.label, seq,
                            [r], entered) for r in never]
        findings += [Finding("not_started", f"rank {r} queued {ref.op} #{seq} on {self.label} "
                             f"but never started it: its stream was still busy with earlier "
                             f"work", self.label, seq, [r], entered) for r in queued]
        if never or queued or (missing and inside):
            if missing:
                findings.append(Finding("missing", _gone(missing), self.label, seq, missing,
                                        entered))
            absent = sorted(never + missing)
            parts = [f"rank(s) {absent} never reached {what}"] * bool(absent)
            parts += [f"rank(s) {queued} queued {'it' if absent else what} but never started "
                      f"it"] * bool(queued)
            parts.append(f"rank(s) {entered} wait in it" if inside else
                         f"rank(s) {entered} entered it, and it ended on them: failed, since "
                         f"it cannot complete without every member")
            return findings, _Head(2, "; ".join(parts), sorted(absent + queued), entered,
                                   self.collective(ref), ref.created_ns)
        if missing:
            why = (f"gloo does not record whether it completed or failed, so whether rank(s) "
                   f"{missing} took part cannot be told" if ref.gloo else
                   f"they completed it, so rank(s) {missing} took part and stopped after it")
            text = f"{_gone(missing)}; rank(s) {entered} last entered {what}, which ended " \
                   f"on them ({why})"
            return [Finding("missing", text, self.label, seq, missing)], _Head(
                3, f"rank(s) {missing} did not dump (dead or stopped): likely culprit(s); "
                   f"the others' last collective, {ref.op} #{seq} on process group "
                   f"{self.label}, ended", missing, [], None, ref.created_ns)
        if inside == entered:
            return [Finding("unfinished", f"every rank is inside {what} and none completed it",
                            self.label, seq, [], inside)], _Head(
                3, f"every rank is inside {what} and none completed it (network or peer "
                   f"failure)", [], inside, self.collective(ref), ref.created_ns)
        if inside and ref.gloo:
            ended = sorted(set(entered) - set(inside))
            return [Finding("cannot_tell", f"whether {what} completed cannot be told: it had "
                            f"ended on rank(s) {ended}, not yet on {inside}, and gloo records "
                            f"neither start nor completion (it marks work retired some time "
                            f"after it completed or failed)", self.label, seq)], None
        return [], None

    def _left(self, rank: int, c: Collective, newest: dict[int, tuple[str, Collective]]) -> bool:
        """Whether ``rank`` went on past gloo collective ``c``: its newest collective is a
        later one of another group. gloo marks a collective ended only once its work
        object is freed, which can lag its end (the caller may still hold it): a rank that
        called a collective of another group since had left this one, which had ended."""
        label, newer = newest.get(rank, (self.label, c))
        return c.gloo and label != self.label and newer.created_ns > c.created_ns

    def _whereabouts(self, rank: int, newest: dict[int, tuple[str, Collective]]) -> str:
        """Where a rank that never arrived was instead, as far as the recorders say."""
        mine, last = self.calls.get(rank, {}), self.last.get(rank, 0)
        where = (f"its last collective there is #{last}" + (f" ({mine[last].op})" if last in
                                                              mine else "") if last > 0
                 else "it recorded no collective there")
        label, c = newest.get(rank, (self.label, None))
        if c is not None and label != self.label:
            where += f"; its newest collective is {c.op} #{c.seq} on {label}"
        return where


def _config_ranks(dumps: dict[int, dict[str, Any]]) -> dict[str, set[int]]:
    """Each group's ranks as the dumps' ``pg_config`` lists them (a JSON list in a string)."""
    out: dict[str, set[int]] = {}
    for d in dumps.values():
        for key, cfg in (d.get("pg_config") or {}).items():
            ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
            try:
                ranks = json.loads(ranks) if isinstance(ranks, str) else ranks
            except ValueError:
                ranks = None
            if ranks:
                out.setdefault(str(key), set()).update(int(r) for r in ranks)
    return out


def _groups(dumps: dict[int, dict[str, Any]]) -> tuple[dict[str, _Group], str]:
    """The process groups the dumps' entries name, and the default group's name."""
    groups: dict[str, _Group] = {}
    # pg_status is keyed by the process's own group ids: the default group's is 0
    # everywhere, another's is known where the same dump has an entry of that group.
    ids: dict[int, dict[str, str]] = {rank: {} for rank in dumps}
    for rank, d in dumps.items():
        for e in d.get("entries") or []:
            if e.get("is_p2p"):
                continue
            c = Collective.from_entry(e)
            ids[rank][str(e.get("pg_id"))] = c.group
            g = groups.setdefault(c.group, _Group(c.group, group_label(c.group, c.desc)))
            g.calls.setdefault(rank, {})[c.seq] = c
            g.last[rank] = max(g.last.get(rank, 0), c.seq)
    default = next((g.name for g in groups.values() if g.label == "default_pg"), _DEFAULT)
    for rank, d in dumps.items():
        ids[rank].setdefault("0", default)
        for pg_id, status in (d.get("pg_status") or {}).items():
            if ids[rank].get(str(pg_id)) in groups and isinstance(status, dict):
                g = groups[ids[rank][str(pg_id)]]
                enqueued = int(status.get("last_enqueued_collective") or 0)
                g.last[rank] = max(g.last.get(rank, 0), enqueued)
    labels = Counter(g.label for g in groups.values())
    for g in groups.values():
        if labels[g.label] > 1:
            g.label += f" (pg {g.name})"
    return groups, default


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
    stuck = sorted(r for r in seen if r not in odd)
    kind = _difference(majority[1:], seen[odd[0]][1:])
    return Report(verdict, culprits=odd, stuck=stuck,
                  collective={"pg": "?", "seq": seq, "op": op, "sizes": [shape],
                              "dtypes": [dtype]},
                  missing_dumps=missing, stacks={r: s for r, s in stacks.items() if r in odd},
                  findings=[Finding(f"{kind}_mismatch", verdict, None, seq, odd, stuck)])


def _world(dumps: dict[int, dict[str, Any]], config: dict[str, set[int]], default: str,
           world_size: int | None) -> tuple[set[int], str | None]:
    """The job's ranks and where they come from (None: guessed from the dumps' ranks)."""
    if world_size:
        return set(range(world_size)), "--world-size"
    listed = config.get(default, set()) | config.get(_UNNAMED, set())
    if listed:
        return listed, "pg_config"
    return set(range(max(dumps) + 1)) if dumps else set(), None  # a gap is a missing rank


def _blocked(heads: list[_Head], blamed: set[int]) -> list[int]:
    """The blamed ranks that wait inside another group's unfinished collective for other
    ranks: with tensor parallelism inside a data-parallel job, a rank stopped in a TP
    all-reduce leaves its TP peer waiting there, and the peer never arrives at the
    data-parallel collective its replicas wait in; the peer is blocked, not a culprit.
    Where every blamed rank waits so (a cycle: each group waits for a rank inside the
    other's), none is called blocked."""
    blocked = {r for h in heads if h.ranks for r in h.waiting if r not in h.ranks} & blamed
    return sorted(blocked) if blamed - blocked else []


def analyze(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> Report:
    """The verdict over ``dumps`` (rank -> dump); ``world_size`` overrides the world that
    ``pg_config`` lists."""
    stacks = {r: d["stacks"]["MainThread"] for r, d in dumps.items()
              if "MainThread" in d.get("stacks", {})}
    config, (groups, default), findings = _config_ranks(dumps), _groups(dumps), []
    world, world_from = _world(dumps, config, default, world_size)
    missing = sorted(world - set(dumps))
    checked = _checked_desync(dumps, missing, stacks)
    if checked:
        return checked
    if dumps and world_from is None:
        findings.append(Finding("cannot_tell", f"whether ranks above {max(dumps)} are missing "
                                f"cannot be told: no dump's pg_config lists the world's ranks "
                                f"(gloo keeps them only until the next group is made); "
                                f"give --world-size"))

    newest = _newest(groups)
    calling = frozenset(r for r, stack in stacks.items() if _in_a_call(stack))
    heads, summary = [], {}
    for g in groups.values():
        if g.name in config:
            g.members, g.known_from = sorted(config[g.name]), "pg_config"
        elif g.name == default and world_from:
            g.members, g.known_from = sorted(world), world_from
        else:  # a rank without a dump may be a member too
            g.members = sorted(set(g.last) | set(missing))
        found, group_heads = [], []
        for check in (g.desync, g.late):
            f, h = check(g.members)
            found, group_heads = found + f, group_heads + [h] * bool(h)
        f, h = g.stuck(g.members, set(dumps), newest, calling)
        if not found or any(x.ranks for x in f):  # a desync or a late rank explains the rest
            found, group_heads = found + f, group_heads + [h] * bool(h)
        if g.known_from == "the dumps" and any(x.kind in _FAULTS for x in found):
            found.append(Finding("cannot_tell", f"process group {g.label}'s members are known "
                                 f"only from the dumps ({g.members}): a member that recorded "
                                 f"nothing there cannot be told from a non-member", g.label))
        findings += found
        heads += group_heads
        summary[g.label] = {"members": g.members, "known_from": g.known_from,
                            "last": {r: g.last[r] for r in sorted(g.last)}}
    unplaced = sorted(set(missing) - {r for f in findings if f.kind == "missing" for r in f.ranks})
    if unplaced:
        findings.append(Finding("missing", _gone(unplaced), ranks=unplaced))
        heads.append(_Head(3, f"rank(s) {unplaced} did not dump (dead or stopped): likely "
                              f"culprit(s)", unplaced, [], None, 0))
    if not any(f.kind.endswith("_mismatch") for f in findings):
        findings.append(Finding("cannot_tell", "whether the ranks passed the same reduce op "
                                "(SUM, MAX, ...) cannot be told: the flight recorder does not "
                                "record it, and such a mismatch neither hangs nor fails"))

    blamed = {r for f in findings if f.kind in _FAULTS for r in f.ranks}
    blocked = _blocked(heads, blamed)
    # the headline is a group that blames no blocked rank, where one does
    heads.sort(key=lambda h: (len(set(h.ranks) & set(blocked)), h.priority, h.since_ns))
    head = heads[0] if heads else None
    if blocked:
        findings.append(Finding("blocked", f"rank(s) {blocked} wait inside an unfinished "
                                f"collective of another group for its culprits: blocked, not "
                                f"to blame where they never arrived", waiting=blocked))
    sentences, named = [], set(blocked)
    for h in heads:  # the headline, then each other group that blames someone new
        if h is head or set(h.ranks) - named:
            sentences.append(h.sentence)
            named |= set(h.ranks)
    if not any(h.collective for h in heads):
        unsure = [f.text for f in findings if f.kind == "cannot_tell" and f.seq]
        sentences = ([f"no fault found in the collectives; {unsure[0]}"] if unsure and not head
                     else ["no rank is inside an unfinished collective"] + sentences)
    verdict = "; ".join(sentences)
    culprits = sorted(blamed - set(blocked))
    stuck = head.waiting if head else []
    return Report(verdict, culprits=culprits, stuck=stuck,
                  collective=head.collective if head else None, missing_dumps=missing,
                  details=[f.text for f in findings], findings=findings, groups=summary,
                  stacks={r: s for r, s in stacks.items() if r in culprits or r in stuck[:1]})


def _in_a_call(stack: str) -> bool:
    """Whether a Python stack's innermost frame is inside torch.distributed (a collective's
    call or its wait)."""
    frames = [line for line in stack.splitlines() if line.lstrip().startswith("File ")]
    return bool(frames) and "/torch/distributed/" in frames[-1]


def _newest(groups: dict[str, _Group]) -> dict[int, tuple[str, Collective]]:
    """Each rank's newest recorded collective over all groups, with its group's label;
    none of a group used off the training thread (:data:`OFF_THREAD`): a checkpoint's
    write that began after the training thread blocked in a collective made that one look
    left, and the blocked rank a culprit."""
    newest: dict[int, tuple[str, Collective]] = {}
    for g in groups.values():
        for r, calls in g.calls.items():
            for c in calls.values():
                if c.desc.startswith(OFF_THREAD):
                    continue
                if r not in newest or c.created_ns > newest[r][1].created_ns:
                    newest[r] = (g.label, c)
    return newest


class _Refused(pickle.UnpicklingError):
    pass


class _DataOnly(pickle.Unpickler):
    """PyTorch's flight-recorder pickles hold only dicts, lists, strings and numbers. A
    pickle that names any class or function (the way a pickle runs code) is refused, so
    analyzing someone else's dumps cannot run their code."""

    def find_class(self, module: str, name: str):
        raise _Refused(f"it asks for {module}.{name}; flight-recorder dumps hold plain data only")


# The rank ends the name: rank-00003.json (llmtrain), nccl_trace_rank_3 or
# comm_lib_trace_rank_3 (PyTorch: TORCH_FR_DUMP_TEMP_FILE's prefix, then the rank).
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")


def load_dumps(url: str) -> dict[int, dict[str, Any]]:
    """Every dump in the directory ``url``: llmtrain's JSON ones, or PyTorch's pickled or
    JSON flight-recorder files (rank taken from the dump, else from the file name's end;
    a PyTorch dump without collectives has no ``entries``, only its groups)."""
    fs, root = fsspec.core.url_to_fs(url)
    dumps: dict[int, dict[str, Any]] = {}
    for path in sorted(p["name"] for p in fs.ls(root, detail=True) if p["type"] == "file"):
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
                log.warning("llmtrain: refused %s: %s", path, e)
                continue
            except Exception:  # noqa: BLE001 - not a dump at all
                continue
        if not isinstance(dump, dict) or not {"entries", "pg_config"} & set(dump):
            continue
        rank = dump.get("rank")
        if rank is None:
            match = _RANK_IN_NAME.search(name)
            if not match:
                log.warning("llmtrain: skipped %s: no rank in the dump or at the end of its "
                            "name", path)
                continue
            rank = int(match.group(1))
        if int(rank) in dumps:
            log.warning("llmtrain: skipped %s: a second dump of rank %s", path, rank)
            continue
        dumps[int(rank)] = dump
    return dumps


def write_report(url: str, report: Report, extra: dict[str, Any]) -> None:
    write_atomic(join(url, "report.json"),
                 json.dumps({**extra, **report.to_json()}, indent=1).encode())
    write_atomic(join(url, "report.md"), report.to_markdown(
        f"Diagnosis: {extra.get('event', '')}").encode())
