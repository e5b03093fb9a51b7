"""Compile once per job, not once per start: torch.compile's artifacts kept in the run dir.

Every start of a compiled run (the first, each cold restart, a warm spare) compiles the
same blocks again: dynamo traces them, AOTAutograd builds forward and backward, and
inductor generates and builds kernels (C++ through the host compiler on CPU, Triton on a
GPU), the longest part of such a start. torch's Mega-Cache
(``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``) packs what inductor
and AOTAutograd cached into one blob; a process that loads it into its own local caches
before it compiles finds the kernels instead of building them (dynamo's trace is redone,
and is short). A node's local cache (``TORCHINDUCTOR_CACHE_DIR``, ``/tmp`` by default)
does the same only on the node that compiled, and a restart mostly lands elsewhere.

Rank 0 saves the blob once its first step has compiled everything, as
``<run_dir>/compile-cache/<key>.bin``, then ``<key>.json``: the blob's size and sha256,
what the key is made of (the graphs' inputs: the model and parallelism sections, the
micro-batch and the sequence length; torch, Triton, Python and the device: a CPU's vector
ISA, which inductor's C++ is built for; a GPU's name and compute capability), and an
HMAC-SHA256 of all that and of the key's name, made with the job's secret
(``LLMTRAIN_JOB_SECRET``, :mod:`llmtrain.distributed.signed_store`). Every rank of every
later start loads it on a thread while the process group forms, and checks it first: a
record not signed with the job's secret (written by anyone but the job, made under another
secret, or moved from another key), a blob that differs from its record (damaged, cut
short, replaced) or a record made under another key (another torch, another device, a
changed model) is not loaded; an event says why and the start compiles as if there were
no cache. A start that loaded it starts no compile workers at its first step (GPU:
:func:`_no_compile_workers`).

Why the signature: the blob holds code (inductor's generated Python, a GPU's Triton
kernels; on CPU the kernel bundle below holds shared objects), and loading it runs that
code on every rank. A sha256 beside it proves nothing against whoever can write the run
dir, as they write the record too; a key the run dir does not hold does. Without a secret
(a plain torchrun job given none), nothing in the run dir can be told from a forgery, so
the run dir's compile cache is neither loaded nor saved (an event and a log line say so at
each start) and inductor caches on the node as torch does alone. A job whose secret is
made anew at each launch (``llmtrain launch``'s own, the Slurm script's unless one is set)
compiles once per launch: the previous launch's record is not signed with its secret.

What a start loads lands in this job's own inductor cache on the node, never in the
node's shared one (``TORCHINDUCTOR_CACHE_DIR``, ``/tmp/torchinductor_<user>`` by default),
where every other job of the user looks for kernels: a subdirectory named after the
secret (by an HMAC of it, which says nothing about it), made inductor's cache for this
process (and the compile workers it starts; a GPU's Triton cache is under it too unless
``TRITON_CACHE_DIR`` says otherwise) before anything compiles. Jobs holding another secret
never look there; a restart of this job on the same node finds its kernels there.

All ranks compile the same graphs (FSDP2 gathers a block's parameters before its compiled
forward runs, and dynamo takes them as inputs), so rank 0's blob serves every rank.

On CPU the blob is not enough: torch bundles a GPU's Triton kernels into its cache entries
but not the C++ kernels inductor builds for a CPU, so a node that never compiled them runs
the host compiler again (most of a CPU start's first step). Rank 0 therefore also keeps the
shared objects its process built, from its inductor cache (``<dir>/??/*.so``, named by the
hash of their source and build command), as ``<key>.kernels.tar``, its sha256 in the
signed record, and a later start puts each one that its job's cache lacks in place before
it compiles: the model's kernels, and inductor's probes of the CPU's vector ISA, which it
builds in every process otherwise (it only tries the ISAs that cpuinfo reports, and loads
each probe in a process of its own). Kernels that were already in rank 0's cache are not
kept: an earlier start of the job built them there.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import importlib.metadata
import io
import json
import logging
import os
import platform
import re
import tarfile
import threading
import time
from dataclasses import asdict
from typing import Protocol

import fsspec
import torch

from llmtrain.config import JobConfig
from llmtrain.distributed.process_group import device_type
from llmtrain.distributed.signed_store import SECRET_ENV, SECRET_FILE_ENV, job_secret
from llmtrain.events import EventLog
from llmtrain.fsio import join, write_atomic

log = logging.getLogger(__name__)

DIR = "compile-cache"
KERNEL_NAME = re.compile(r"[0-9a-z]{2}/[0-9A-Za-z_.]+\.so")  # inductor's CPU kernels
SIGNATURE = "hmac_sha256"  # the record's field holding its signature


def cache_key(cfg: JobConfig, device: torch.device) -> dict:
    """What a blob is good for; a blob made under other parts is not loaded."""
    graphs = {"model": asdict(cfg.model), "parallelism": asdict(cfg.parallelism),
              "micro_batch_size": cfg.training.micro_batch_size, "seq_len": cfg.data.seq_len}
    return {"graphs": hashlib.sha256(json.dumps(graphs, sort_keys=True).encode())
            .hexdigest()[:16],
            "torch": torch.__version__, "triton": _version("triton"),
            "python": platform.python_version(), "device": _device_kind(device)}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda {torch.cuda.get_device_name(device)} sm{major}{minor} " \
               f"(CUDA {torch.version.cuda})"
    # what inductor's choice of vector ISA rests on, read from cpuinfo as inductor reads
    # it (its pick itself compiles probes: the kernel bundle below carries them too)
    flags = [name for name, has in (
        ("avx2", torch.cpu._is_avx2_supported()), ("avx512", torch.cpu._is_avx512_supported()),
        ("avx512_vnni", torch.cpu._is_vnni_supported()),
        ("amx_tile", torch.cpu._is_amx_tile_supported())) if has]
    return (f"{device.type} {platform.machine()} {torch.backends.cpu.get_cpu_capability()} "
            f"{'+'.join(flags) or '-'}")


def job_inductor_dir(secret: bytes) -> str:
    """This job's own inductor cache on this node, made this process's (and its compile
    workers') inductor cache from now on: ``llmtrain-job-<HMAC of the secret>`` in the
    node's (``TORCHINDUCTOR_CACHE_DIR``, else under ``/tmp``), which no job holding another
    secret looks in. Call it before anything compiles."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    node = cache_dir()
    name = "llmtrain-job-" + hmac.new(secret, b"llmtrain inductor cache",
                                      hashlib.sha256).hexdigest()[:16]
    path = node if os.path.basename(node) == name else os.path.join(node, name)  # 2nd start
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _signature(secret: bytes, key: str, body: dict) -> str:
    message = b"\0".join((b"llmtrain compile cache", key.encode(),
                          json.dumps(body, sort_keys=True, separators=(",", ":")).encode()))
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def signed_record(secret: bytes, key: str, body: dict) -> dict:
    """``body`` (what a record says: the artifacts' sizes and digests, the key's parts)
    with its signature for ``key``: an HMAC-SHA256 with the job's secret over the key's
    name and the whole body, so no field can change and the record cannot serve another
    key."""
    return {**body, SIGNATURE: _signature(secret, key, body)}


def signed_for(secret: bytes, key: str, record: dict) -> bool:
    """Whether ``record`` was signed for ``key`` with ``secret``."""
    body = {name: value for name, value in record.items() if name != SIGNATURE}
    return hmac.compare_digest(str(record.get(SIGNATURE)).encode(),
                               _signature(secret, key, body).encode())


def _counters() -> dict[str, int]:
    """This process's cache hits and misses so far: inductor's FX graphs, AOTAutograd's."""
    from torch._dynamo.utils import counters
    return {"graph_hits": counters["inductor"]["fxgraph_cache_hit"],
            "graph_misses": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]}


class CompileCaching(Protocol):
    """The run's compile cache as the training loop uses it, on (:class:`CompileCache`)
    or off (:class:`NoCompileCache`): see :func:`compile_cache_for`."""

    def ready(self) -> None:
        """Waits for the load begun at the start (before the first step)."""

    def first_step_done(self) -> str | None:
        """After the first step: what the start reused and compiled, in a line (None:
        nothing to say)."""


class CompileCache:
    """One rank's side of the run's compile cache: loading starts at once, on a thread;
    ``ready`` waits for it before the first step; ``first_step_done`` says what the start
    reused and, on rank 0, saves what it compiled."""

    def __init__(self, run_dir: str, parts: dict, events: EventLog, rank: int,
                 secret: bytes):
        """``parts``: the key's parts (:func:`cache_key`); ``secret``: the job's, which
        signs the records; this process's inductor cache becomes the job's own
        (:func:`job_inductor_dir`)."""
        self.dir, self.events, self.rank = join(run_dir, DIR), events, rank
        self.parts, self.key, self._secret = parts, _digest(parts), secret
        self.inductor_dir = job_inductor_dir(secret)
        self.loaded = 0  # artifacts loaded from the run dir
        self.load_s = 0.0
        self.loaded_sha: str | None = None
        self.record: dict = {}
        self.ignored: str | None = None  # why a blob there was not loaded
        self.kernels = 0  # CPU kernels put in the job's inductor cache
        self.began = time.time()  # kernels built after this, this process built
        self._thread = threading.Thread(target=self._load, name="llmtrain-compile-cache",
                                        daemon=True)
        self._thread.start()

    def ready(self) -> None:
        self._thread.join()

    def first_step_done(self) -> str | None:
        """Everything is compiled now: one ``compile_cache`` event per rank and start;
        returns what this start reused, in a line."""
        counts = _counters()
        saved, save_error = False, None
        compiled = not self.loaded or counts["graph_misses"] or counts["autograd_misses"]
        if self.rank == 0 and compiled:
            try:
                saved = self._save()
            except Exception as e:  # noqa: BLE001 - the next start compiles, no worse
                save_error = f"{type(e).__name__}: {e}"
        self.events.emit("compile_cache", key=self.key, loaded=self.loaded,
                         kernels=self.kernels, load_s=round(self.load_s, 3),
                         ignored=self.ignored, saved=saved,
                         save_error=save_error, **counts)
        reused = (f"loaded {self.loaded} artifacts and {self.kernels} CPU kernels from "
                  f"{self.dir}" if self.loaded
                  else f"nothing loaded ({self.ignored or 'none saved yet'})")
        if not compiled:
            made = "compiled nothing"
        elif saved:
            made = f"compiled, saved to {self.dir}"
        elif save_error:
            made = f"compiled, not saved: {save_error}"
        else:
            made = "compiled"
        return f"compile cache: {reused}; {made}"

    def _load(self) -> None:
        began = time.perf_counter()
        try:
            blob = self._checked_blob()
            if blob is not None:
                info = torch.compiler.load_cache_artifacts(blob)
                if info is None:
                    self._ignore("torch could not read it (see the warning in the log)")
                else:
                    self.loaded = sum(len(names) for names in info.artifacts.values())
                    self.loaded_sha = hashlib.sha256(blob).hexdigest()
                    self.kernels = self._put_kernels()
                    _no_compile_workers()
        except Exception as e:  # noqa: BLE001 - a cache is never worth a failed start
            self._ignore(f"loading it failed: {type(e).__name__}: {e}")
        self.load_s = time.perf_counter() - began

    def _checked_blob(self) -> bytes | None:
        """This key's blob, once its record, signed for this key with the job's secret,
        vouches for it; None when there is none."""
        fs, path = fsspec.core.url_to_fs(self.dir)
        record_path = f"{path}/{self.key}.json"
        if not fs.exists(record_path):
            others = fs.glob(f"{path}/*.json") if fs.exists(path) else []
            if others:
                self._ignore(self._stale(fs, others))
            return None
        record = json.loads(fs.cat_file(record_path))
        if not signed_for(self._secret, self.key, record):
            self._ignore(f"{self.key}.json is not signed for this key with the job's secret "
                         f"(made under another secret, moved from another key, or written "
                         f"by someone else): nothing of it is trusted")
            return None
        self.record = record
        blob = fs.cat_file(f"{path}/{self.key}.bin")
        if len(blob) != record["bytes"] or hashlib.sha256(blob).hexdigest() != record["sha256"]:
            self._ignore(f"{self.key}.bin is not the blob its record describes ({len(blob)} "
                         f"bytes, {record['bytes']} recorded): damaged or cut short")
            return None
        return blob

    def _stale(self, fs: fsspec.AbstractFileSystem, records: list[str]) -> str:
        """Why the newest record there was made for another start."""
        newest = max((json.loads(fs.cat_file(p)) for p in records),
                     key=lambda record: record.get("saved", 0))
        theirs = newest.get("parts", {})
        changed = [f"{name} {theirs.get(name)!r} (now {mine!r})"
                   for name, mine in self.parts.items() if theirs.get(name) != mine]
        return f"made for another {', '.join(changed) or 'key'}"

    def _ignore(self, why: str) -> None:
        self.ignored = why
        self.events.emit("compile_cache_ignored", dir=self.dir, key=self.key, reason=why)

    def _put_kernels(self) -> int:
        """The record's CPU kernels that the job's inductor cache lacks, put there; how
        many. A bundle that is not what the signed record says is not opened."""
        kept = self.record.get("kernels")
        if not kept:
            return 0
        fs, path = fsspec.core.url_to_fs(self.dir)
        bundle = fs.cat_file(f"{path}/{self.key}.kernels.tar")
        if hashlib.sha256(bundle).hexdigest() != kept["sha256"]:
            self._ignore(f"{self.key}.kernels.tar is not the bundle its record describes: "
                         f"damaged or replaced; its kernels are built again")
            return 0
        root = self.inductor_dir
        put = 0
        with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
            for member in tar.getmembers():
                if not (member.isfile() and KERNEL_NAME.fullmatch(member.name)):
                    continue  # only <2 chars>/<name>.so, nothing that could land elsewhere
                target = os.path.join(root, member.name)
                if os.path.exists(target):
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                tmp = f"{target}.tmp-{os.getpid()}-{threading.get_native_id()}"
                with open(tmp, "wb") as f:
                    f.write(tar.extractfile(member).read())
                os.replace(tmp, target)  # ranks of one node may put the same kernel at once
                put += 1
        return put

    def _built_kernels(self) -> bytes | None:
        """A tar of the CPU kernels this process built (none: None)."""
        root = self.inductor_dir
        names = [n for n in (os.path.relpath(p, root)
                             for p in glob.glob(os.path.join(root, "??", "*.so")))
                 if KERNEL_NAME.fullmatch(n)
                 and os.path.getmtime(os.path.join(root, n)) >= self.began]
        if not names:
            return None
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for name in sorted(names):
                tar.add(os.path.join(root, name), arcname=name)
        return out.getvalue()

    def _save(self) -> bool:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        blob = saved[0]
        sha = hashlib.sha256(blob).hexdigest()
        if sha == self.loaded_sha:
            return False
        write_atomic(join(self.dir, f"{self.key}.bin"), blob)
        body = {"key": self.key, "parts": self.parts, "bytes": len(blob), "sha256": sha,
                "saved": time.time()}
        kernels = self._built_kernels()
        if kernels is not None:
            write_atomic(join(self.dir, f"{self.key}.kernels.tar"), kernels)
            body["kernels"] = {"bytes": len(kernels),
                               "sha256": hashlib.sha256(kernels).hexdigest()}
        record = signed_record(self._secret, self.key, body)
        write_atomic(join(self.dir, f"{self.key}.json"), json.dumps(record, indent=1).encode())
        return True


def _no_compile_workers() -> None:
    """Inductor compiles a GPU's Triton kernels in a pool of worker processes (one per
    CPU, each importing torch), which its backend starts at each start's first compile,
    even where every kernel comes from the cache. After a load, none is started: on a
    node of several ranks that is one process per CPU for each rank, starting just as the
    restarted ranks take their first step. A kernel that must be compiled after all
    starts the pool then (it compiles in the rank's own process until the pool is up).
    Nothing on CPU (no Triton)."""
    os.environ["TORCH_WARM_POOL"] = "0"  # read by torch's inductor backend at each compile


class NoCompileCache:
    """``parallelism.compile`` off, ``parallelism.compile_cache`` off, or no job secret."""

    def ready(self) -> None:
        pass

    def first_step_done(self) -> str | None:
        return None  # nothing to say


def compile_cache_for(cfg: JobConfig, rank: int, local_rank: int,
                      events: EventLog) -> CompileCaching:
    p = cfg.parallelism
    if not (p.compile and p.compile_cache):
        return NoCompileCache()
    kind = device_type(p)
    device = torch.device(kind, local_rank) if kind == "cuda" else torch.device(kind)
    parts, secret = cache_key(cfg, device), job_secret()
    if secret is None:
        if rank == 0:
            why = (f"no job secret ({SECRET_ENV} or {SECRET_FILE_ENV}) to sign and check it "
                   f"with: the run dir's compile cache is neither loaded nor saved")
            log.warning("compile cache: %s", why)
            events.emit("compile_cache_ignored", dir=join(cfg.training.run_dir, DIR),
                        key=_digest(parts), reason=why)
        return NoCompileCache()
    return CompileCache(cfg.training.run_dir, parts, events, rank, secret)
