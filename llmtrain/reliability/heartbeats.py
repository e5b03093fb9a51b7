"""The watchdog's control plane: heartbeats and collective arrival times reduced per node,
then across nodes, so that no rank's work and no store request grows with the world.

Ranks form blocks of ``local_world_size`` consecutive ranks (a node under torchrun, which
numbers a node's ranks consecutively); a block's first rank is its leader. Each heartbeat:

- every rank ``set``s its heartbeat under ``hb/<rank>``: one request;
- a leader reads its block's heartbeats (one ``multi_get``) and ``set``s one summary under
  ``node/<leader>``: the ranks whose heartbeat is stale, and where the quiet ranks are in
  each process group (the newest collective they entered, whether they are still inside
  it, for how long, and how long it usually takes), compacted per (group, sequence number,
  call) into a count and at most ``LISTED`` ranks;
- rank 0 reads the summaries (a ``multi_get`` per 256 nodes: O(nodes) bytes) into a
  :class:`World`, which the watchdog judges: silent ranks, desyncs, ranks that have not
  arrived. A summary gone stale (its leader stopped) is replaced by rank 0 reading that
  block itself.

Each straggler window has the same shape: ranks ``set`` their collectives' arrival times,
a leader reduces its block's to the first arrival at each collective and each rank's
summed lateness behind it, and rank 0 combines the blocks into the ``LISTED`` slowest
ranks and the distribution (a histogram at 1 % resolution). Per heartbeat a rank makes
2 requests, a leader 3 more over O(block) bytes, rank 0 2 per 256 nodes over O(nodes)
bytes: the store serves O(world) in all, and every event stays the same size at any
scale. ``benchmarks/control_plane.py`` measures it at 256-16K simulated ranks.
"""

from __future__ import annotations

import base64
import json
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from llmtrain.distributed.signed_store import SignedStore

from llmtrain.reliability import flightrec
from llmtrain.reliability.liveness import Liveness

LISTED = 8  # ranks a summary names per party (the rest are counted), and the top stragglers
_ARRIVALS = 512  # recent collectives whose arrival times a rank publishes each window
_USUAL_OF = 16  # recent completions of a (group, op) its usual duration is the median of
_PACKED = np.dtype("<i8")
_CHUNK = 256  # keys per store request


def _call(c: flightrec.Collective) -> str:
    """What ranks in one collective must agree on. All-to-all may take other sizes on every
    rank: only its op and dtypes."""
    uneven = "to_all" in c.op or "toall" in c.op
    return f"{c.op} dtypes={c.dtypes}" if uneven else c.signature()


def positions(entries: list[dict], now_ns: int, counted_from_ns: int = 0) -> dict[str, list]:
    """Per process group, the newest collective this rank entered: [seq, call, inside,
    seconds inside it (0 when out), its usual duration in seconds (None: never seen done)].
    The seconds inside count from ``counted_from_ns`` at the earliest: a time this process
    was not running (its machine paused) is nobody's wait.

    The usual duration is the median of the group's recent completed collectives of that
    op: their recorded completion where the backend records it (NCCL), else the time to the
    rank's next collective in the group (gloo records no completion): an upper bound."""
    by_group: dict[str, list[flightrec.Collective]] = defaultdict(list)
    for c in map(flightrec.Collective.from_entry, entries):
        by_group[c.desc if c.desc not in ("", "undefined") else f"pg {c.group}"].append(c)
    out: dict[str, list] = {}
    for name, calls in by_group.items():
        calls.sort(key=lambda c: c.seq)
        took: dict[str, list[float]] = defaultdict(list)
        for c, after in zip(calls, calls[1:]):
            end = c.completed_ns or (after.created_ns if not c.inside else 0)
            if end and c.created_ns:
                took[c.op].append((end - c.created_ns) / 1e9)
        last = calls[-1]
        usual = took.get(last.op, [])[-_USUAL_OF:]
        out[name] = [last.seq, _call(last), last.inside,
                     round((now_ns - max(last.created_ns, counted_from_ns)) / 1e9, 3)
                     if last.inside else 0.0,
                     round(statistics.median(usual), 4) if usual else None]
    return out


@dataclass
class Party:
    """Ranks in the same place: how many, the first ``LISTED`` of them, the longest wait
    among them and the longest usual duration they reported."""
    count: int = 0
    ranks: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    usual_s: float | None = None

    def add(self, count: int, ranks: list[int], wait_s: float, usual_s: float | None) -> None:
        self.count += count
        self.ranks = sorted(self.ranks + ranks)[:LISTED]
        self.wait_s = max(self.wait_s, wait_s)
        if usual_s is not None:
            self.usual_s = max(self.usual_s or 0.0, usual_s)

    def named(self) -> str:
        more = self.count - len(self.ranks)
        return f"{self.ranks}" + (f" and {more} more" if more > 0 else "")


def summarize(beats: dict[int, dict], now: float, stale_s: float,
              liveness: Liveness | None = None) -> dict:
    """A block's heartbeats as one bounded record: stale ones (and of those, the ones
    ``liveness`` sees running: starved, not stopped), and quiet ranks compacted per
    (group, seq, call, inside)."""
    silent = [[r, round(now - b["wall"], 3), b["step"], b["phase"]]
              for r, b in sorted(beats.items()) if now - b["wall"] > stale_s]
    running = [r for r, *_ in silent
               if liveness is not None and liveness.running(r, beats[r], now)]
    at: dict[tuple, Party] = defaultdict(Party)
    for r, b in sorted(beats.items()):
        for pg, (seq, call, inside, wait_s, usual_s) in (b.get("at") or {}).items():
            at[pg, seq, call, inside].add(1, [r], wait_s, usual_s)
    return {"wall": now, "silent": silent, "running": running,
            "at": [[*key, p.count, p.ranks, p.wait_s, p.usual_s] for key, p in at.items()]}


@dataclass
class World:
    """Rank 0's view of every block: each silent rank's (seconds silent, step, phase), the
    silent ranks seen running by a peer on their host, the quiet ranks' parties by (group,
    seq, call, inside), and the leaders whose summary was stale, so that rank 0 read their
    blocks itself."""
    silent: dict[int, tuple[float, int, str]] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)
    at: dict[tuple, Party] = field(default_factory=lambda: defaultdict(Party))
    stale: list[int] = field(default_factory=list)

    def add(self, summary: dict, now: float) -> None:
        late = max(0.0, now - summary["wall"])  # the summary's age adds to every silence
        for r, age, step, phase in summary["silent"]:
            self.silent[r] = (age + late, step, phase)
        self.running.update(summary.get("running", ()))
        for pg, seq, call, inside, count, ranks, wait_s, usual_s in summary["at"]:
            self.at[pg, seq, call, inside].add(count, ranks, wait_s + late * inside, usual_s)


def desync_in(world: World) -> str | None:
    """Ranks inside the same collective (group and sequence number) with different calls:
    which called what, the largest party first."""
    seen: dict[tuple[str, int], dict[str, Party]] = defaultdict(dict)
    for (pg, seq, call, inside), party in world.at.items():
        if inside:
            seen[pg, seq][call] = party
    for (pg, seq), calls in sorted(seen.items()):
        if len(calls) > 1:
            parties = sorted(calls.items(), key=lambda kv: (-kv[1].count, kv[1].ranks))
            return (f"desync in {pg} at collective #{seq}: " +
                    "; ".join(f"rank(s) {p.named()} called {call}" for call, p in parties))
    return None


def not_arrived(world: World, factor: float, floor_s: float) -> tuple[str, list[int]] | None:
    """(reason, ranks named) when ranks have waited in collective #N of a group longer
    than ``factor`` times its usual duration (``floor_s`` at least) while quiet ranks of
    the group have entered only earlier ones: #N cannot finish without them. None when
    ``factor`` is 0 or nothing qualifies. A rank silent since it said where it was, whom
    a peer on its host saw running, is starved, not behind: where it was is old news."""
    if not factor:
        return None
    for (pg, seq, call, inside), waiting in sorted(world.at.items(), key=lambda kv: kv[0][:2]):
        if not inside or waiting.usual_s is None:
            continue
        limit = max(floor_s, factor * waiting.usual_s)
        if waiting.wait_s <= limit:
            continue
        behind = Party()
        for (pg2, seq2, _, _), p in world.at.items():
            if pg2 == pg and seq2 < seq:
                ranks = [r for r in p.ranks if r not in world.running]
                behind.add(p.count - (len(p.ranks) - len(ranks)), ranks, 0.0, None)
        if behind.count:
            return (f"rank(s) {behind.named()} have not arrived at {call.split()[0]} #{seq} "
                    f"on {pg}: rank(s) {waiting.named()} have waited there "
                    f"{waiting.wait_s:.1f} s, over {factor:g}x its usual "
                    f"{waiting.usual_s:.2f} s"), behind.ranks
    return None


def awaited(world: World, stale_s: float, factor: float,
            starved: bool = False) -> tuple[str, list[int]] | None:
    """(reason, ranks named) when ranks have waited inside a collective longer than
    ``stale_s`` (and ``factor`` times its usual duration) while other ranks send no
    heartbeat: those are stopped (SIGSTOP, a process frozen whole), since a rank's watchdog
    thread beats even while its training thread waits or computes. Named as soon as that
    is seen, not after the hang timeout: their peers wait for them and cannot go on. A
    silent rank a peer on its host saw running is starved, not stopped: not named (the
    hang timeout still judges its silence); ``starved`` names those instead."""
    silent = {r: s for r, s in world.silent.items()
              if s[0] > stale_s and (r in world.running) == starved}
    if not factor or not silent:
        return None
    for (pg, seq, call, inside), waiting in sorted(world.at.items(), key=lambda kv: kv[0][:2]):
        if not inside or waiting.wait_s <= max(stale_s, factor * (waiting.usual_s or 0.0)):
            continue
        ranks = sorted(silent)
        longest = max(s[0] for s in silent.values())
        return (f"rank(s) {ranks} sent no heartbeat for up to {longest:.1f} s while rank(s) "
                f"{waiting.named()} waited {waiting.wait_s:.1f} s in {call.split()[0]} #{seq} "
                f"on {pg}: " + ("running, but starved" if starved else "stopped or frozen")
                ), ranks
    return None


def silence(rank: int, seconds: float, step: int, phase: str) -> str:
    return (f"rank {rank} sent no heartbeat for {seconds:.0f} s (last at step {step}, "
            f"{phase}): stopped or dead")


def verdict(world: World, timeout_s: float, factor: float, floor_s: float,
            stale_s: float) -> tuple[str, str] | None:
    """(kind, reason) of what rank 0 sees in ``world``: a rank silent for ``timeout_s`` (a
    hang), a desync (a collective error), a silent rank others wait for, a rank that has
    not arrived (hangs); or None."""
    for r, (silent, step, phase) in sorted(world.silent.items()):
        if silent > timeout_s:
            return "hang", silence(r, silent, step, phase)
    desync = desync_in(world)
    if desync:
        return "collective_error", desync
    late = awaited(world, stale_s, factor) or not_arrived(world, factor, floor_s)
    return ("hang", late[0]) if late else None


@dataclass
class Scores:
    """One straggler window: ranks compared, collectives compared, the slowest ranks with
    their slowdowns (largest first), and the distribution's quantiles."""
    ranks: int
    collectives: int
    top: list[tuple[int, float]]
    p50: float
    p90: float
    p99: float


def _bin(slowdown: float) -> int:
    return round(100 * math.log(max(slowdown, 1e-9)))


class ControlPlane:
    """One rank's part in the aggregation: ``publish`` on every rank, ``summarize`` and
    ``reduce_arrivals`` on a block's leader, ``world`` and ``stragglers`` on rank 0. Works
    on any store (a :class:`SignedStore` view) and needs no process group."""

    def __init__(self, store: SignedStore, rank: int, world_size: int, local_world_size: int,
                 heartbeat_interval_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.block = local_world_size if 0 < local_world_size < world_size else world_size
        self.leaders = range(0, world_size, self.block)
        self.leader = rank % self.block == 0
        # A beating rank refreshes within one interval (and the time a tick takes): past
        # one and a half, its watchdog thread has stopped, or is starved for half an
        # interval. Silence alone names a rank only past the hang timeout; silence while
        # others wait for it in a collective, at once (:func:`awaited`).
        self.stale_s = 1.5 * heartbeat_interval_s
        self.liveness = Liveness(self.stale_s)  # silent ranks on this host: starved or stopped
        self.since_ns = 0  # arrivals before this (an older generation of the groups) are past

    def _members(self, leader: int) -> range:
        return range(leader, min(leader + self.block, self.world_size))

    def _read(self, keys: list[str]) -> dict[str, bytes]:
        """The keys that exist, with their signed values (a forged one reads as absent,
        and is reported): a ``check`` and a ``multi_get`` per ``_CHUNK`` keys once all do
        (TCPStore's grow faster than their keys beyond about a thousand)."""
        out: dict[str, bytes] = {}
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i:i + _CHUNK]
            if not self.store.check(chunk):  # start-up, or a rank gone: find which exist
                chunk = [k for k in chunk if self.store.check([k])]
            if chunk:
                out.update((k, v) for k, v in zip(chunk, self.store.genuine_values(chunk))
                           if v is not None)
        return out

    def beats(self, ranks) -> dict[int, dict]:
        """The latest heartbeats of those of ``ranks`` that have published one. A rank's
        silence counts from the groups' newest generation at the earliest: the beat of a
        lost rank's process is the spare's until the spare, which took its place in that
        generation, publishes its first. Where a beat published before that says its rank
        is in a collective, it is an older generation's: not judged."""
        raw = self._read([f"hb/{r}" for r in ranks])
        beats = {int(k[3:]): json.loads(v) for k, v in raw.items()}
        for beat in beats.values():
            if beat["wall"] < self.since_ns / 1e9:
                beat["wall"], beat["at"] = self.since_ns / 1e9, None
        return beats

    # -- heartbeats -------------------------------------------------------------------

    def publish(self, beat: dict) -> None:
        self.store.set(f"hb/{self.rank}", json.dumps(beat))

    @property
    def members(self) -> range:
        """The ranks whose heartbeats this rank summarizes as their block's leader."""
        return self._members(self.rank)

    def summarize(self, beats: dict[int, dict] | None = None) -> None:
        """Leader: the block's heartbeats (``beats``, read now if not given) as one
        summary."""
        beats = self.beats(self.members) if beats is None else beats
        self.store.set(f"node/{self.rank}", json.dumps(summarize(beats, time.time(),
                                                                 self.stale_s, self.liveness)))

    def world(self) -> World:
        """Rank 0: every block's summary; a block whose summary is missing, stale, or made
        before the groups' newest generation began is read rank by rank. (A leader's
        summary from just before a warm recovery still looked fresh to a spare that became
        rank 0: it had the survivors waiting in the old groups' collective, for a rank that
        never came, and the spare declared a hang in the new generation, which went cold.)"""
        raw = self._read([f"node/{leader}" for leader in self.leaders])
        now, world = time.time(), World()
        for leader in self.leaders:
            summary = raw.get(f"node/{leader}")
            summary = json.loads(summary) if summary is not None else None
            if summary is None or now - summary["wall"] > self.stale_s \
                    or summary["wall"] < self.since_ns / 1e9:
                world.stale.append(leader)
                summary = summarize(self.beats(self._members(leader)), now, self.stale_s,
                                    self.liveness)
            world.add(summary, now)
        return world

    # -- arrivals at collectives ------------------------------------------------------

    def publish_arrivals(self, entries: list[dict]) -> None:
        """When this rank entered each of its recent completed collectives, by group name
        and sequence number: after a warm recovery the survivors' groups and a spare's have
        the same names but not the same ``pg_id``s."""
        done = [e for e in entries[-_ARRIVALS:]
                if e.get("retired") and e["time_created_ns"] >= self.since_ns]
        self.store.set(f"arrivals/{self.rank}", json.dumps(
            {f"{e['process_group'][0]}|{e['collective_seq_id']}": e["time_created_ns"]
             for e in done}))

    def reduce_arrivals(self) -> None:
        """Leader: the block's first arrival at each collective all its ranks recorded, the
        last arrival, and each rank's lateness behind the block's first, summed: the
        slowest ``LISTED`` ranks by name, all of them as a histogram of their slowdown
        within the block."""
        raw = self._read([f"arrivals/{r}" for r in self._members(self.rank)])
        arrivals = {int(k.rpartition("/")[2]): json.loads(v) for k, v in raw.items()}
        if not arrivals:
            return
        common = set.intersection(*(set(a) for a in arrivals.values()))
        if not common:
            return
        first = {k: min(a[k] for a in arrivals.values()) for k in common}
        last = max(a[k] for a in arrivals.values() for k in common)
        span = max(last - min(first.values()), 1)
        late = {r: sum(a[k] - first[k] for k in common) for r, a in arrivals.items()}
        hist: dict[int, int] = defaultdict(int)
        for lateness in late.values():
            hist[_bin(span / max(span - lateness, 1))] += 1
        top = sorted(late.items(), key=lambda kv: -kv[1])[:LISTED]
        # The first arrivals packed for rank 0, which reads every block's: per group, the
        # first sequence number and the microseconds after the block's earliest of each
        # from there (-1: a gap), as little-endian int64 in base64, which rank 0 decodes at
        # C speed rather than as JSON numbers.
        base = min(first.values())
        seqs: dict[str, dict[int, int]] = defaultdict(dict)
        for k, t in first.items():
            pg, _, seq = k.partition("|")
            seqs[pg][int(seq)] = (t - base) // 1000
        packed = {}
        for pg, us in seqs.items():
            offsets = np.full(max(us) - min(us) + 1, -1, dtype=_PACKED)
            offsets[np.fromiter(us, dtype=np.int64) - min(us)] = list(us.values())
            packed[pg] = [min(us), base64.b64encode(offsets.tobytes()).decode()]
        self.store.set(f"arrivals/node/{self.rank}", json.dumps(
            {"base": base, "first": packed, "last": last, "late": top, "hist": hist}))

    def stragglers(self) -> Scores | None:
        """Rank 0: each rank's slowdown over the collectives every block recorded.

        In a collective everyone waits for the last to arrive, so a rank whose work takes f
        times as long is late by (f - 1) of the others' work at every step. Over those
        collectives a rank's slowdown is span / (span - its summed lateness), about 1 for
        everyone else; its lateness is its block's lateness behind the first block plus
        its own behind its block's first. None until 20 collectives are common."""
        raw = self._read([f"arrivals/node/{leader}" for leader in self.leaders])
        blocks = [json.loads(v) for v in raw.values()]
        if not blocks:
            return None
        bases = np.array([b["base"] for b in blocks], dtype=np.int64)[:, None]
        firsts = [{pg: (lo, np.frombuffer(base64.b64decode(us), dtype=_PACKED))
                   for pg, (lo, us) in b["first"].items()} for b in blocks]
        behind, start, collectives = np.zeros(len(blocks), dtype=np.int64), None, 0
        for pg in set.intersection(*(set(f) for f in firsts)):
            lo = max(f[pg][0] for f in firsts)
            hi = min(f[pg][0] + len(f[pg][1]) for f in firsts)
            if hi <= lo:
                continue
            us = np.stack([f[pg][1][lo - f[pg][0]:hi - f[pg][0]] for f in firsts])
            ns = us[:, (us >= 0).all(axis=0)] * 1000 + bases  # blocks x common collectives
            first = ns.min(axis=0)
            behind += (ns - first).sum(axis=1)
            collectives += ns.shape[1]
            start = first.min() if start is None else min(start, first.min())
        if collectives < 20:
            return None
        span = max(max(b["last"] for b in blocks) - int(start), 1)
        top: list[tuple[int, float]] = []
        hist: dict[int, int] = defaultdict(int)
        for b, behind in zip(blocks, behind.tolist()):
            shift = _bin(span / max(span - behind, 1))
            for slot, count in b["hist"].items():
                hist[int(slot) + shift] += count
            top += [(r, span / max(span - behind - late, 1)) for r, late in b["late"]]
        top = sorted(top, key=lambda rs: -rs[1])[:LISTED]
        ranks = sum(hist.values())
        cumulative, quantiles = 0, {}
        for slot in sorted(hist):
            cumulative += hist[slot]
            for q in (0.5, 0.9, 0.99):
                if q not in quantiles and cumulative >= q * ranks:
                    quantiles[q] = round(math.exp(slot / 100), 3)
        return Scores(ranks, collectives, [(r, round(s, 3)) for r, s in top],
                      quantiles[0.5], quantiles[0.9], quantiles[0.99])

    def close(self) -> None:
        """The rendezvous store outlives the round: leave it none of this rank's keys."""
        keys = [f"hb/{self.rank}", f"arrivals/{self.rank}"]
        keys += [f"node/{self.rank}", f"arrivals/node/{self.rank}"] * self.leader
        for key in keys:
            self.store.delete_key(key)
