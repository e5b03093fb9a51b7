"""DCP shard files as raw tensor bytes: the save's data path.

DCP's stock file format stores every tensor as a ``torch.save`` archive, so a save pays a
zip writer (with CRC32) per tensor and a load pays ``torch.load`` (an unpickling and a
fresh buffer) per tensor, then a second copy into the destination, on one thread. Here a
tensor is stored as its bare bytes (C order, native byte order); its dtype and shape are
already in DCP's ``.metadata`` (the chunk's global offsets and sizes), its place in the
file in the item's ``_StorageInfo``, which also carries the descriptor :data:`.index.RAW`.

Writing is one ``write`` per 4 MiB of a tensor's memory, each piece hashed by the
writing thread while it is still in the CPU cache, on several writer threads, one file
each. Every item's checksum goes into its ``_StorageInfo`` (a descriptor
``xxh3_128=<hex>``; ``sha256=`` in checkpoints written before, see
:mod:`llmtrain.checkpoint.checksum`), so a reader can check exactly what it reads
(:mod:`llmtrain.checkpoint.shard_read`, :mod:`llmtrain.checkpoint.in_place`), and the
manifest commits to the item sums (:mod:`llmtrain.checkpoint.storage`).

Everything else is DCP's: planners, resharding, ``.metadata``, non-tensor items (bytes,
written as they are). Stock ``FileSystemReader``/``FsspecReader`` refuse the new files
(unknown extension ``llmtrain-raw``) rather than misread them.
"""

from __future__ import annotations

import io
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.filesystem import (DEFAULT_SUFFIX, _split_by_size_and_type,
                                                     _StorageInfo)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from llmtrain.checkpoint import direct_io
from llmtrain.checkpoint.index import RAW
from llmtrain.checkpoint.staging import lower_priority


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as bytes, C order (a view when it is on CPU and contiguous),
    as a save writes them; the common case (a plain CPU tensor, contiguous, of a dtype
    numpy knows) takes numpy's view directly, at half the general path's cost."""
    if type(tensor) is torch.Tensor:  # a subclass converts in its own way
        try:
            return memoryview(tensor.numpy()).cast("B")
        except (TypeError, RuntimeError):  # not on CPU or contiguous, bf16, needs grad
            pass
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def write_shards(fs, root, plan, planner, thread_count: int, raw: bool = True,
                 nice: int = 0) -> Future:
    """Writes this rank's items of ``plan`` to ``thread_count`` files on as many threads.
    ``fs`` is DCP's FileSystem whose streams fsync as the storage needs and have
    ``write_item(view) -> its checksum, labelled``
    (:class:`llmtrain.checkpoint.storage.CommitWriter`). ``raw`` False writes DCP's own
    items instead (a tensor as ``torch.save`` of it, no descriptors), which stock DCP
    readers load; each file's sha256 is then in the manifest only. ``nice``: added to
    each writer thread's niceness (:func:`.staging.lower_priority`)."""
    buckets = [b for b in _split_by_size_and_type(thread_count, plan.items) if b]
    names = [f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]

    def write(name: str, items) -> list[WriteResult]:
        results, offset = [], 0
        with fs.create_stream(fs.concat_path(root, name), "wb") as stream:
            for item in sorted(items, key=_file_order):
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view, descriptors = data.getbuffer(), []
                elif raw:
                    view, descriptors = tensor_bytes(data), [RAW]
                else:
                    view, descriptors = stock_item(data), []
                if raw:  # each item hashed on its own, its sum kept beside it
                    descriptors.append(stream.write_item(view))
                else:  # the file hashed whole: stock readers refuse unknown descriptors
                    stream.write(view)
                results.append(WriteResult(index=item.index, size_in_bytes=len(view),
                                           storage_data=_StorageInfo(name, offset, len(view),
                                                                     descriptors or None)))
                offset += len(view)
        return results

    # once per thread, not per file: a thread that finishes a file early takes the next
    # one and must not lower itself again; the pool's threads end with this save
    with ThreadPoolExecutor(max_workers=max(1, len(buckets)), initializer=lower_priority,
                            initargs=(nice,)) as pool:
        done = list(pool.map(write, names, buckets))
    fut: Future = Future()
    fut.set_result([r for results in done for r in results])
    return fut


def _file_order(item) -> tuple[bool, bool]:
    """Where an item goes in its file. Tensors first: their places then stay from one
    save to the next while the objects' sizes change (a load keeps its layout for as long,
    :func:`.in_place.plan_in_place`). Of those, the ones of whole pages first: each then
    starts a page of the file as it starts one of the staging buffers, which a direct
    write takes as it lies, with no copy, up to the first tensor of another size
    (direct_io)."""
    if item.type == WriteItemType.BYTE_IO:
        return True, True
    data = item.tensor_data
    nbytes = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
    return False, nbytes % direct_io.ALIGN != 0


def stock_item(tensor: torch.Tensor) -> memoryview:
    """A tensor as DCP's stock writer stores it: ``torch.save`` of a CPU copy that owns
    exactly its elements (a view would drag its whole storage along)."""
    t = tensor.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getbuffer()
