"""Staging for async saves: the state is copied into host buffers made once and reused,
on a thread of its own while the next step's forward and backward run.

DCP's ``DefaultStager`` keeps its buffers from save to save too, but rebuilds the staged
state dict around them at every save (a deepcopy of every tensor and DTensor wrapper,
then a copy storage by storage): on 2 CPU cores that staged at 0.29-0.41 of memcpy speed
(``benchmarks/checkpoint.py``). Here the buffers (pinned on CUDA, shared with
``async_process``) are made once, carved from one host allocation (``_host_buffers``),
and again only when the state's layout changes; each save walks the state once, checking
its layout against the buffers' and pairing each tensor with its buffer, then copies
every pair in one ``torch._foreach_copy_`` (torch's ``_copy_state_dict``, a walk making
a Python call per tensor, after another walk to compare the layouts, took about 6 ms
more than plain copies of a 143 MB rank's 300 tensors at 2 ranks here; this, about 1).
The manager starts a save only after the previous one finished writing, so the buffers
are never overwritten while DCP still reads them. The trainer has them made after its
first step (``prepare``), so the first save does not wait for them either.

``stage`` pairs the tensors with their buffers on the caller's thread (that walk is
Python, which would hold the GIL against it) and returns with a future (DCP's
``AsyncSaveResponse.staging_completion``); ``start`` then begins the copy, on the staging
thread, niced as the writers are, on CUDA on a side stream ordered after the work already
queued. The buffers start pages, so a direct write takes them as they lie
(:mod:`llmtrain.checkpoint.direct_io`). Only the optimizer step changes what is copied,
so the trainer waits for the future before it (``CheckpointManager.wait_staged``), and
the copy costs the step nothing when it ends within forward and backward.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from llmtrain.state_registry import local_shard

# bytes: each buffer starts a page, where a direct write takes its bytes as they lie
# (llmtrain.checkpoint.direct_io); a few KB more a state than at 64
_ALIGN = 4096


def page_span(nbytes: int) -> int:
    """The bytes ``nbytes`` take in a host block whose every buffer starts a page."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _paired(state_dict: dict, buffers: dict, seen: dict) -> tuple[dict, list, list, dict]:
    """(``state_dict`` over ``buffers``, their local tensors, the live ones, what the next
    pairing may take as it is): see _over."""
    dst: list = []
    src: list = []
    now: dict = {}
    return _over(state_dict, buffers, dst, src, seen, now), dst, src, now


class _LayoutChanged(Exception):
    """The state no longer has the buffers' layout."""


def _over(obj: Any, buffers: Any, dst: list, src: list, seen: dict, now: dict) -> Any:
    """``obj`` with each tensor replaced by its buffer in ``buffers`` (made for the same
    layout), adding each pair's local tensors to ``dst`` and ``src``; raises
    _LayoutChanged where a key, a kind of tensor, a shape or a dtype differs.

    A tensor that the last pairing (``seen``, by ``id``) paired with the same buffer,
    over the same local tensor, is taken as it was then, its shape and dtype not read
    again: a DTensor's are Python properties, half of this walk's 1.1 ms a 2-rank save
    here. A tensor object keeps its shape and dtype unless its ``.data`` is swapped,
    which nothing here does: FSDP gives a parameter a new local tensor, a load gives
    the optimizer new state tensors, and either is paired anew. ``now`` gets this
    pairing's, for the next: (the tensor, its buffer, the buffer's local tensor, the
    tensor's), the live ones by weak reference, so that none outlives its state."""
    if isinstance(obj, torch.Tensor):
        live = local_shard(obj)
        last = seen.get(id(obj))
        if last is None or last[0]() is not obj or last[1] is not buffers \
                or last[3]() is not live:
            if type(buffers) is not type(obj) or buffers.shape != obj.shape \
                    or buffers.dtype != obj.dtype:
                raise _LayoutChanged
            last = (weakref.ref(obj), buffers, local_shard(buffers), weakref.ref(live))
            if last[2].shape != live.shape:
                raise _LayoutChanged
        now[id(obj)] = last
        dst.append(last[2])
        src.append(live)
        return buffers
    if isinstance(obj, dict):
        if not isinstance(buffers, dict) or buffers.keys() != obj.keys():
            raise _LayoutChanged
        return {k: _over(v, buffers[k], dst, src, seen, now) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if type(buffers) is not type(obj) or len(buffers) != len(obj):
            raise _LayoutChanged
        return type(obj)(_over(v, b, dst, src, seen, now) for v, b in zip(obj, buffers))
    if isinstance(buffers, torch.Tensor):
        raise _LayoutChanged
    return obj


class ReusedBufferStager(AsyncStager):
    _synchronize_after_execute = False

    def __init__(self, *, cuda: bool, share_memory: bool, nice: int = 0):
        """``cuda``: the state is on a CUDA device (pinned buffers, a side stream).
        ``nice``: added to the staging thread's niceness (:func:`lower_priority`): its
        copy then takes the CPU the training threads leave idle, not theirs."""
        self.pin_memory, self.share_memory = cuda, share_memory
        self._buffers: dict | None = None
        # the rank's GPU in the staging thread too: registering memory from a thread on
        # no device would open a context on GPU 0 for every rank of the node
        device = torch.cuda.current_device() if cuda else None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtrain-staging",
                                          initializer=_staging_thread, initargs=(device, nice))
        self._stream = torch.cuda.Stream() if cuda else None
        self.copy_s: float | None = None  # the last staging's copy time, on its thread
        self._pending: Callable[[], None] | None = None  # the copy :meth:`start` begins
        self._seen: dict = {}  # the last pairing's tensors (see _over)

    def prepare(self, state_dict: dict) -> Future:
        """Makes the buffers for ``state_dict``'s layout now, on the staging thread, ahead
        of the first save (pinning a GPU's state takes seconds)."""
        return self._thread.submit(lambda: self._staged(state_dict)[0])

    def stage(self, state_dict: dict) -> Future:
        """The future of the copy of ``state_dict``, which :meth:`start` begins."""
        if self._stream is not None:  # the copy reads what the queued work last wrote
            self._stream.wait_stream(torch.cuda.current_stream())
        # The walk pairing each tensor with its buffer is Python, done here: the staging
        # thread would hold the GIL with it while the caller goes on with the save.
        # Buffers to make anew (a new layout) are made on the staging thread: pinning
        # them takes seconds on a GPU.
        try:
            paired = (None if self._buffers is None
                      else _paired(state_dict, self._buffers, self._seen))
        except _LayoutChanged:
            paired = None
        staged: Future = Future()
        self._pending = functools.partial(self._copy_into, staged, state_dict, paired)
        return staged

    def start(self) -> None:
        """Begins the copy of the last :meth:`stage`. The manager calls it once DCP's save
        call has returned: a copy running during that call, on 2 cores at 2 ranks, had
        its Python wait for the GIL and the copy's time slices, 1.7-8 ms a save where it
        otherwise takes about 1.5."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._thread.submit(pending)

    def _copy_into(self, staged: Future, state_dict: dict, paired: tuple | None) -> None:
        try:
            staged.set_result(self._copy(state_dict, paired))
        except BaseException as e:  # DCP's upload thread waits for it: it must end
            staged.set_exception(e)

    def _staged(self, state_dict: dict) -> tuple[dict, list, list, dict]:
        """``state_dict`` over the buffers, and the (buffer, live) local tensors to copy:
        buffers made anew where its layout is not theirs."""
        if self._buffers is not None:
            try:
                return _paired(state_dict, self._buffers, self._seen)
            except _LayoutChanged:  # the old block goes before the new one is made
                self._buffers, self._seen = None, {}
        self._buffers = _host_buffers(state_dict, pin=self.pin_memory, share=self.share_memory)
        return _paired(state_dict, self._buffers, {})

    def _copy(self, state_dict: dict, paired: tuple | None) -> dict:
        start = time.perf_counter()
        staged, dst, src, self._seen = paired or self._staged(state_dict)
        if dst and self._stream is None:
            torch._foreach_copy_(dst, src)
        elif dst:  # device to pinned host: torch copies such pairs one by one, queued
            with torch.cuda.stream(self._stream):
                torch._foreach_copy_(dst, src, non_blocking=True)
            self._stream.synchronize()
        self.copy_s = time.perf_counter() - start
        return staged

    def release(self) -> None:
        """Forgets the buffers: a write let go of may still read them (the manager's
        ``disown``), so the next save makes its own."""
        self._buffers, self._seen = None, {}

    def synchronize_staging(self) -> None:
        """Staging ends with its future: nothing more to wait for."""

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._buffers, self._seen = None, {}


def lower_priority(nice: int) -> None:
    """Adds ``nice`` to the calling thread's niceness. On Linux each thread is a task with
    its own nice value, so a staging or writer thread gets less CPU than the training
    threads only while they compete for it (at 10: about a tenth of a busy core's share),
    and all of an idle one. Elsewhere, or where refused, the thread keeps its priority."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                 + nice))
    except (AttributeError, OSError):
        pass


def _staging_thread(device: int | None, nice: int) -> None:
    lower_priority(nice)
    if device is not None:
        torch.cuda.set_device(device)


def _host_buffers(state_dict: dict, *, pin: bool, share: bool) -> dict:
    """Host tensors shaped like each tensor of ``state_dict`` (DTensors keep their spec),
    views into one block that is allocated, and pinned, once.

    torch's ``_create_cpu_state_dict`` copies every DTensor to the host first (a pageable,
    synchronous copy of the whole state, only to take its shape), then pins each tensor
    through the caching host allocator, which rounds each one up to a power of two. On an
    H200 the first async save of a 1B model's 13 GB state stalled training 14.5 s. The
    block is pinned where it lies (``cudaHostRegister``), not taken from that allocator,
    which would round the block up too (a 17 GB state pinned as 32 GiB) and keep it cached
    after a layout change.
    """
    tensors: list[torch.Tensor] = []
    _map_tensors(state_dict, tensors.append)
    block, locals_ = host_block([local_shard(t) for t in tensors], pin=pin, share=share)
    views = {id(t): _dtensor(view, t, block) if isinstance(t, DTensor) else view
             for t, view in zip(tensors, locals_)}
    return _map_tensors(state_dict, lambda t: views[id(t)])


def host_block(tensors: list[torch.Tensor], *, pin: bool,
               share: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(one host block, a view into it shaped like each of ``tensors``), the block made
    once, shared where ``share``, and pinned where it lies where ``pin``."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + page_span(n))
    # anonymous memory, which starts on a page (torch's allocator aligns to 64 bytes),
    # and shared memory too, both at no offset into their storage (see _dtensor)
    block = torch.frombuffer(mmap.mmap(-1, max(starts[-1], 1)), dtype=torch.uint8)
    if share:
        block.share_memory_()
    if pin:
        pin_memory_utils.pin_memory(block.data_ptr(), block.numel())
        # unpinned when the memory goes: with the last view, not with ``block`` (a view
        # does not keep the tensor it was cut from alive, only their shared storage)
        weakref.finalize(block.untyped_storage(), pin_memory_utils.unpin_memory,
                         block.data_ptr())
    return block, [block[start:start + n].view(t.dtype).view(t.shape)
                   for t, start, n in zip(tensors, starts, sizes)]


def _dtensor(view: torch.Tensor, like: DTensor, block: torch.Tensor) -> DTensor:
    """A DTensor with ``like``'s spec over ``view``. The wrapper is made around a view at
    the block's start and then given ``view``: a wrapper takes its local tensor's storage
    offset, and pickling one with an offset (``async_process`` sends the staged state to
    its process) crashes torch 2.13."""
    wrapper = DTensor(block[:view.nbytes].view(view.dtype).view(view.shape), like._spec,
                      requires_grad=False)
    wrapper._local_tensor = view
    return wrapper


def _map_tensors(obj: Any, fn) -> Any:
    """``obj`` rebuilt with each tensor replaced by ``fn(tensor)``, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj
