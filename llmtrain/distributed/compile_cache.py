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
and what the key is made of: the graphs' inputs (the model and parallelism sections, the
micro-batch and the sequence length), torch, Triton, Python and the device (a CPU's
vector ISA, which inductor's C++ is built for; a GPU's name and compute capability).
Every rank of every later start loads it on a thread while the process group forms, and
checks it first: a blob that differs from its record (damaged, cut short) or a record made
under another key (another torch, another device, a changed model) is not loaded; an
event says why and the start compiles as if there were no cache. The blob is the job's
own output in its own run dir, written and read like its checkpoints; nothing from
elsewhere is loaded.

All ranks compile the same graphs (FSDP2 gathers a block's parameters before its compiled
forward runs, and dynamo takes them as inputs), so rank 0's blob serves every rank.

On CPU the blob is not enough: torch bundles a GPU's Triton kernels into its cache entries
but not the C++ kernels inductor builds for a CPU, so a node that never compiled them runs
the host compiler again (most of a CPU start's first step). Rank 0 therefore also keeps the
shared objects its process built, from its inductor cache (``<dir>/??/*.so``, named by the
hash of their source and build command), as ``<key>.kernels.tar``, checked by its own
sha256 in the record, and a later start puts each one that its node lacks in place before
it compiles: the model's kernels, and inductor's probes of the CPU's vector ISA, which it
builds in every process otherwise (it only tries the ISAs that cpuinfo reports, and loads
each probe in a process of its own). Kernels that were already on rank 0's node are not
kept: that node had them from before this job.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import tarfile
import threading
import time
from dataclasses import asdict

import fsspec
import torch

from llmtrain.config import JobConfig
from llmtrain.distributed.process_group import device_type
from llmtrain.events import EventLog
from llmtrain.fsio import join, write_atomic

DIR = "compile-cache"
KERNEL_NAME = re.compile(r"[0-9a-z]{2}/[0-9A-Za-z_.]+\.so")  # inductor's CPU kernels


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


def _inductor_dir() -> str:
    """This node's inductor cache (``TORCHINDUCTOR_CACHE_DIR``, else under ``/tmp``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _counters() -> dict[str, int]:
    """This process's cache hits and misses so far: inductor's FX graphs, AOTAutograd's."""
    from torch._dynamo.utils import counters
    return {"graph_hits": counters["inductor"]["fxgraph_cache_hit"],
            "graph_misses": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]}


class CompileCache:
    """One rank's side of the run's compile cache: loading starts at once, on a thread;
    ``ready`` waits for it before the first step; ``first_step_done`` says what the start
    reused and, on rank 0, saves what it compiled."""

    def __init__(self, run_dir: str, parts: dict, events: EventLog, rank: int):
        """``parts``: the key's parts (:func:`cache_key`)."""
        self.dir, self.events, self.rank = join(run_dir, DIR), events, rank
        self.parts, self.key = parts, _digest(parts)
        self.loaded = 0  # artifacts loaded from the run dir
        self.load_s = 0.0
        self.loaded_sha: str | None = None
        self.record: dict = {}
        self.ignored: str | None = None  # why a blob there was not loaded
        self.kernels = 0  # CPU kernels put in this node's inductor cache
        self.began = time.time()  # kernels built after this, this process built
        self._thread = threading.Thread(target=self._load, name="llmtrain-compile-cache",
                                        daemon=True)
        self._thread.start()

    def ready(self) -> None:
        self._thread.join()

    def first_step_done(self) -> str:
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
        except Exception as e:  # noqa: BLE001 - a cache is never worth a failed start
            self._ignore(f"loading it failed: {type(e).__name__}: {e}")
        self.load_s = time.perf_counter() - began

    def _checked_blob(self) -> bytes | None:
        """This key's blob, once its record vouches for it; None when there is none."""
        fs, path = fsspec.core.url_to_fs(self.dir)
        record_path = f"{path}/{self.key}.json"
        if not fs.exists(record_path):
            others = fs.glob(f"{path}/*.json") if fs.exists(path) else []
            if others:
                self._ignore(self._stale(fs, others))
            return None
        record = self.record = json.loads(fs.cat_file(record_path))
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
        """The record's CPU kernels that this node's inductor cache lacks, put there; how
        many. A bundle that is not what the record says is not opened."""
        kept = self.record.get("kernels")
        if not kept:
            return 0
        fs, path = fsspec.core.url_to_fs(self.dir)
        bundle = fs.cat_file(f"{path}/{self.key}.kernels.tar")
        if hashlib.sha256(bundle).hexdigest() != kept["sha256"]:
            self._ignore(f"{self.key}.kernels.tar is not the bundle its record describes: "
                         f"damaged; its kernels are built again")
            return 0
        root = _inductor_dir()
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
        root = _inductor_dir()
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
        record = {"key": self.key, "parts": self.parts, "bytes": len(blob), "sha256": sha,
                  "saved": time.time()}
        kernels = self._built_kernels()
        if kernels is not None:
            write_atomic(join(self.dir, f"{self.key}.kernels.tar"), kernels)
            record["kernels"] = {"bytes": len(kernels),
                                 "sha256": hashlib.sha256(kernels).hexdigest()}
        write_atomic(join(self.dir, f"{self.key}.json"), json.dumps(record, indent=1).encode())
        return True


class NoCompileCache:
    """``parallelism.compile`` off, or ``parallelism.compile_cache`` off."""

    def ready(self) -> None:
        pass

    def first_step_done(self) -> None:
        return None  # nothing to say


def compile_cache_for(cfg: JobConfig, rank: int, local_rank: int,
                      events: EventLog) -> CompileCache | NoCompileCache:
    p = cfg.parallelism
    if not (p.compile and p.compile_cache):
        return NoCompileCache()
    kind = device_type(p)
    device = torch.device(kind, local_rank) if kind == "cuda" else torch.device(kind)
    return CompileCache(cfg.training.run_dir, cache_key(cfg, device), events, rank)
