"""The training state resharded from memory onto another mesh: what lets the survivors of
a lost node go on at a smaller world size from their snapshots and their wards' replicas,
and a job take in spares at a larger one from the running ranks' copies of a step,
reading nothing from storage.

FSDP2 shards each parameter, and with it its optimizer state, on dim 0 over the mesh's
``dp_shard`` dimension as ``torch.chunk`` does: shard ``s`` of ``S`` holds rows
``[s*c, min(N, (s+1)*c))`` of ``N``, ``c = ceil(N/S)``; the ``dp_replicate`` replicas hold
the same shards. A rank's shard at the new mesh is assembled from the old shards whose rows
overlap it, copied where this rank holds one (its own snapshot, or the replica of a lost
ward), else sent by a rank that holds it. Each rank so receives at most its new shard's
bytes, never the whole state (an all-gather would send the whole state to every rank).
A shrink of HSDP that drops whole replicas leaves every survivor's shard where it is:
nothing is sent. With tensor parallelism (``tp`` consecutive ranks split each block, and
FSDP shards their pieces again, in strides), only whole replicas come and go: a rank's
tensors are then those of its *unit*, its place within a replica, and move whole from a
rank of the same unit (a grow's newcomer), or stay where they are.

The pieces one rank sends another travel in one buffer with its XXH3 checksum, checked
before any byte lands in the state: every held snapshot was verified against its own
checksum first, and this closes the gap in between.

Which rank sends an old shard to a rank that lacks it is a pure function of the plan
(``providers``): every rank computes the same sends and receives without asking. A
newcomer (a grow's spare) holds nothing: it also receives the unsharded tensors (the
optimizer's step counts) whole, and rank 0's header, whose shared items (the data
position, the schedule) it loads; its own RNGs stay as built, as a cold restart's new
rank's do.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from llmtrain.checkpoint import checksum
from llmtrain.checkpoint.snapshots import Snapshot, SnapshotError
from llmtrain.state_registry import local_shard

_DIGEST = 16  # bytes of an XXH3-128 digest


@dataclass(frozen=True)
class Mesh:
    """A mesh's shape: ``replicate`` × ``shard`` data-parallel ranks, each a group of
    ``tp`` consecutive ranks; rank ``(r*shard+s)*tp+t`` holds shard ``s`` of tensor-parallel
    piece ``t`` (as :func:`llmtrain.distributed.process_group.build_mesh` lays it out)."""
    replicate: int
    shard: int
    tp: int = 1

    @property
    def units(self) -> int:
        """The ranks of one replica: each holds tensors no other rank of it holds."""
        return self.shard * self.tp

    def unit_of(self, rank: int) -> int:
        return rank % self.units

    def shard_of(self, rank: int) -> int:
        return rank % self.shard

    def rows(self, n_rows: int, shard: int) -> tuple[int, int]:
        """The rows of ``n_rows`` that ``shard`` holds, as ``torch.chunk`` splits them."""
        chunk = -(-n_rows // self.shard)
        return min(n_rows, shard * chunk), min(n_rows, (shard + 1) * chunk)

    def ranks_of(self, shard: int) -> range:
        return range(shard, self.replicate * self.shard, self.shard)


@dataclass
class _Piece:
    tensor: int        # its index in the state's tensors
    source: int        # the old rank whose snapshot holds it
    rows: tuple[int, int] | None  # global rows of the tensor; None: all of an unsharded one


@dataclass
class Moves:
    """This rank's part of a reshard: pieces it copies from its own memory, sends, and
    receives, each list in the order both ends enumerate it."""
    copies: list[_Piece] = field(default_factory=list)
    sends: dict[int, list[_Piece]] = field(default_factory=lambda: defaultdict(list))
    receives: dict[int, list[_Piece]] = field(default_factory=lambda: defaultdict(list))


def _sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is FSDP's kind of shard (dim 0 over one mesh dimension, replicated
    over any other); ValueError for a layout this module cannot move."""
    if not isinstance(t, DTensor):
        return False
    kinds = [p for p in t.placements if not isinstance(p, Replicate)]
    if not kinds:
        return False
    if kinds != [Shard(0)]:
        raise ValueError(f"cannot reshard a tensor placed {t.placements} from memory "
                         f"(only FSDP's dim-0 shards): use the cold path")
    return True


def whole_units(old: Mesh, new: Mesh) -> bool:
    """Whether only whole replicas come and go: every rank's tensors are then its unit's,
    moved whole. The only resize with tensor parallelism (its strided shards are not
    FSDP's rows)."""
    return (old.shard, old.tp) == (new.shard, new.tp)


def plan_unit_moves(rank: int, count: int, providers: dict[int, int], old: Mesh, new: Mesh
                    ) -> Moves:
    """What ``rank`` copies, sends and receives when only whole replicas come and go
    (:func:`whole_units`): each new rank takes all ``count`` state tensors of its unit
    whole, from its own memory when it holds a snapshot of that unit, else from a rank
    that does (a newcomer's, the unsharded ones too)."""
    holders: dict[int, dict[int, int]] = defaultdict(dict)  # unit -> new rank -> old rank
    for o in sorted(providers):
        holders[old.unit_of(o)].setdefault(providers[o], o)
    missing = [u for u in range(old.units) if u not in holders]
    if missing:
        raise SnapshotError(f"no survivor holds the tensors of unit(s) {missing} in memory")
    moves = Moves()
    for n in range(new.replicate * new.units):
        held = holders[new.unit_of(n)]
        p = n if n in held else sorted(held)[n % len(held)]
        for i in range(count):
            piece = _Piece(i, held[p], None)
            if n == rank:
                (moves.copies if p == rank else moves.receives[p]).append(piece)
            elif p == rank:
                moves.sends[n].append(piece)
    return moves


def plan_moves(rank: int, rows: list[int | None], providers: dict[int, int], old: Mesh,
               new: Mesh, newcomers: frozenset[int] = frozenset()) -> Moves:
    """What ``rank`` (of the new mesh) copies, sends and receives. ``rows``: each state
    tensor's dim-0 length where it is sharded, None where every rank holds all of it;
    ``providers``: each old rank's snapshot -> the new rank holding it in memory (every old
    shard must have one); ``newcomers``: new ranks that hold no snapshot (a grow's), which
    also receive the unsharded tensors whole."""
    holders: dict[int, dict[int, int]] = defaultdict(dict)  # old shard -> new rank -> old rank
    for o in sorted(providers):
        holders[old.shard_of(o)].setdefault(providers[o], o)
    missing = [s for s in range(old.shard) if s not in holders]
    if missing:
        raise SnapshotError(f"no survivor holds old shard(s) {missing} in memory")

    def provider(n: int, s: int) -> tuple[int, int]:
        """The new rank that gives new rank ``n`` old shard ``s``, and whose snapshot."""
        held = holders[s]
        p = n if n in held else sorted(held)[n % len(held)]
        return p, held[p]

    moves = Moves()
    for i, n_rows in enumerate(rows):
        if n_rows is None:  # the holder of old shard 0 gives a newcomer all of it
            for n in sorted(newcomers):
                p, o = provider(n, 0)
                if rank == n:
                    moves.receives[p].append(_Piece(i, o, None))
                elif rank == p:
                    moves.sends[n].append(_Piece(i, o, None))
            continue
        old_chunk = -(-n_rows // old.shard)
        # as the receiver: the old shards overlapping this rank's new rows
        a, b = new.rows(n_rows, new.shard_of(rank))
        for s in range(a // old_chunk, -(-b // old_chunk)) if b > a else ():
            lo, hi = old.rows(n_rows, s)
            p, o = provider(rank, s)
            piece = _Piece(i, o, (max(a, lo), min(b, hi)))
            (moves.copies if p == rank else moves.receives[p]).append(piece)
        # as a sender: the new ranks overlapping the old shards this rank gives away
        new_chunk = -(-n_rows // new.shard)
        for s in sorted(s for s, held in holders.items() if rank in held):
            lo, hi = old.rows(n_rows, s)
            for ns in range(lo // new_chunk, -(-hi // new_chunk)) if hi > lo else ():
                a, b = new.rows(n_rows, ns)
                for n in new.ranks_of(ns):
                    p, o = provider(n, s)
                    if n != rank and p == rank and min(b, hi) > max(a, lo):
                        moves.sends[n].append(_Piece(i, o, (max(a, lo), min(b, hi))))
    return moves


def reshard(held: dict[int, Snapshot], providers: dict[int, int], old: Mesh, new: Mesh,
            live: list[torch.Tensor], own: int | None, group: dist.ProcessGroup,
            newcomers: frozenset[int] = frozenset()) -> dict:
    """Fills ``live`` (this rank's state at the new mesh: the tensors of
    :func:`llmtrain.state_registry.state_entries`, any optimizer's)
    from the old mesh's snapshots, held across the new group's ranks as ``providers`` says
    (``held``: the verified ones in this rank's memory, by old rank; ``own``: this rank's
    old rank, whose unsharded tensors and header it keeps, None for a newcomer). Returns
    that header; a newcomer's is rank 0's, whose shared items it takes."""
    rank = dist.get_rank(group)
    whole = whole_units(old, new)
    rows = [None if whole or not _sharded(t) else t.shape[0] for t in live]
    moves = (plan_unit_moves(rank, len(live), providers, old, new) if whole else
             plan_moves(rank, rows, providers, old, new, newcomers))
    parts = {o: snap.parts() for o, snap in held.items()}
    locals_ = [local_shard(t) for t in live]
    row_bytes = [t.element_size() * math.prod(t.shape[1:]) for t in locals_]
    if own is not None and not whole:  # (whole units: the moves copy a survivor's own)
        own_layout = held[own].header["layout"]
        for i, (t, n_rows) in enumerate(zip(locals_, rows)):
            if n_rows is None:
                if [str(t.dtype).removeprefix("torch."), list(t.shape)] != own_layout[i]:
                    raise SnapshotError(f"state tensor {i} is {t.dtype} {list(t.shape)} "
                                        f"here but {own_layout[i]} in the snapshot "
                                        f"(another config?)")
                _dest(t).copy_(parts[own][i])

    def source(piece: _Piece) -> torch.Tensor:
        whole = parts[piece.source][piece.tensor]
        if piece.rows is None:
            return whole
        lo, _ = old.rows(rows[piece.tensor], old.shard_of(piece.source))
        a, b = piece.rows
        n = row_bytes[piece.tensor]
        return whole[(a - lo) * n:(b - lo) * n]

    def dest(piece: _Piece) -> torch.Tensor:
        whole = _dest(locals_[piece.tensor])
        if piece.rows is None:
            return whole
        start, _ = new.rows(rows[piece.tensor], new.shard_of(rank))
        a, b = piece.rows
        n = row_bytes[piece.tensor]
        return whole[(a - start) * n:(b - start) * n]

    with torch.no_grad():
        for piece in moves.copies:
            dest(piece).copy_(source(piece))
        works, inbound = [], {}
        for peer, pieces in sorted(moves.sends.items()):
            out = torch.cat([source(p) for p in pieces])
            works += [dist.isend(out, peer, group=group),
                      dist.isend(_digest(out), peer, group=group)]
        for peer, pieces in sorted(moves.receives.items()):
            buf = torch.empty(sum(dest(p).numel() for p in pieces), dtype=torch.uint8)
            digest = torch.empty(_DIGEST, dtype=torch.uint8)
            works += [dist.irecv(buf, peer, group=group), dist.irecv(digest, peer, group=group)]
            inbound[peer] = (buf, digest, pieces)
        for w in works:
            w.wait()
        for peer, (buf, digest, pieces) in inbound.items():
            if not torch.equal(digest, _digest(buf)):
                raise SnapshotError(f"the state rank {peer} sent while resharding arrived "
                                    f"damaged (checksum mismatch)")
            at = 0
            for p in pieces:
                d = dest(p)
                d.copy_(buf[at:at + d.numel()])
                at += d.numel()
    return _header(held[own].header if own is not None else None, rank, newcomers, group)


def _header(mine: dict | None, rank: int, newcomers: frozenset[int],
            group: dist.ProcessGroup) -> dict:
    """This rank's header; a newcomer's, rank 0's, sent as JSON (its shared items: the
    data position, the schedule, the integrity window)."""
    if rank == 0:
        text = json.dumps(mine).encode()
        for n in sorted(newcomers):
            dist.send(torch.tensor([len(text)]), n, group=group)
            dist.send(torch.frombuffer(bytearray(text), dtype=torch.uint8), n, group=group)
    if rank not in newcomers:
        return mine
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, 0, group=group)
    text = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(text, 0, group=group)
    return json.loads(bytes(text.numpy()))


def _dest(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)  # a view: what is copied in lands in ``t``


def _digest(buf: torch.Tensor) -> torch.Tensor:
    hasher = checksum.new()
    hasher.update(memoryview(buf.numpy()))
    return torch.frombuffer(bytearray(hasher.digest()), dtype=torch.uint8)
