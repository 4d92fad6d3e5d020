"""Packed weights moved into one buffer backed by transparent huge pages (Linux, 2 MiB pages).

Every pass streams all of a model's weights once. In 4 KiB pages that is one page-table entry per
4 KiB read, tens of thousands a pass, more than the TLB holds, so each pass walks the page tables
again; in 2 MiB pages a pass touches a few dozen. The bytes and the arithmetic are unchanged: the
same weights, copied, give the same bits (tested). A small gain, on decoding's passes only
(a prompt's prefill is bound by arithmetic): docs/backends.md, "The matrices in 2 MiB pages".

Linux gives huge pages to an anonymous mapping that asks for them (`madvise(MADV_HUGEPAGE)`) when
`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`, and when it finds free 2
MiB frames at the first touch; otherwise the mapping keeps 4 KiB pages and nothing else changes.
`SPECDEC_HUGE_PAGES=0` leaves the weights where packing put them.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

ENV = "SPECDEC_HUGE_PAGES"
PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on its own 4 KiB boundary (the kernels' loads assume 64 bytes)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def unavailable_reason() -> str | None:
    """Why weights stay in 4 KiB pages here, or None when they can move."""
    if os.environ.get(ENV, "1") == "0":
        return f"${ENV}=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "transparent huge pages are Linux's"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"{THP_SETTING} is not readable"
    if "[never]" in setting:
        return "transparent huge pages are off ([never])"
    return None


def place(tensors: Iterable[torch.Tensor]) -> int:
    """Copy each contiguous tensor into one huge-page buffer and point the tensor there (the same
    Python object: everything holding it sees the move). Tensors sharing a storage are moved
    together and keep sharing it. Returns the bytes moved (0 where `unavailable_reason`)."""
    if unavailable_reason() is not None:
        return 0
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.requires_grad:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    if not storages:
        return 0
    offsets, size = [], 0
    for storage, _ in storages.values():
        offsets.append(size)
        size += -(-storage.nbytes() // ALIGN) * ALIGN
    # An anonymous mapping a page larger than needed, used from its first 2 MiB boundary, asked
    # for huge pages before anything touches it (a page's size is chosen at its first fault).
    pages = -(-size // PAGE) * PAGE
    mapped = mmap.mmap(-1, pages + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping alive
    start = -whole.data_ptr() % PAGE
    mapped.madvise(mmap.MADV_HUGEPAGE, start, pages)
    arena = whole[start : start + size]
    for (storage, group), offset in zip(storages.values(), offsets):
        nbytes = storage.nbytes()
        arena[offset : offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        for tensor in group:
            element = tensor.element_size()
            with torch.no_grad():
                tensor.set_(arena.untyped_storage(), (start + offset) // element + tensor.storage_offset(),
                            tensor.size(), tensor.stride())
    return size

