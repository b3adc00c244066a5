"""Page-aligned flat buffers, and mapping a shared-memory file's pages into them.

A trainer's flat parameter and gradient buffers (see :mod:`elasticps.trainer.flat`)
are allocated here, page-aligned and private to the process. When the
placement allows it (:func:`elasticps.placement.page_runs`), the client maps
the pages of the memory it shares with each parameter server over the pages
of the flat buffers that hold that server's shard (``mmap`` with
``MAP_FIXED``), so that the gradients autograd writes are the ones the server
reads, and the parameters the server writes are the model's: a push copies
nothing on the trainer. :func:`unmap_pages` gives the pages private memory
again, with the same contents, when the connection ends.

Linux only (``memfd``, ``MAP_FIXED``), with 4 KiB pages; :func:`supported`
says whether this process can do it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from functools import cache

import torch

from elasticps.placement import PAGE_NUMEL

PAGE_BYTES = PAGE_NUMEL * 4
"""Bytes in a page of the flat buffers (4 KiB)."""

_MAP_FIXED = 0x10  # <sys/mman.h>, the same on every Linux architecture
_MAP_FAILED = ctypes.c_void_p(-1).value


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    return libc


def supported() -> bool:
    """Whether shared-memory pages can be mapped into flat buffers here (Linux, 4 KiB pages)."""
    return sys.platform == "linux" and mmap.PAGESIZE == PAGE_BYTES and _libc() is not None


def page_aligned_zeros(numel: int) -> torch.Tensor:
    """A float32 ``[numel]`` tensor of zeros, starting on a page, private to this process.

    It owns whole pages (the last one padded), so that :func:`map_file_pages`
    may map other memory over any of them. Freed with the tensor (and every
    view of it).
    """
    nbytes = max(1, -(-numel * 4 // PAGE_BYTES)) * PAGE_BYTES
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.float32, count=numel)


def is_page_aligned(buf: torch.Tensor) -> bool:
    """Whether ``buf`` starts on a page (as :func:`page_aligned_zeros` tensors do)."""
    return buf.data_ptr() % PAGE_BYTES == 0


def _mmap_fixed(address: int, nbytes: int, flags: int, fd: int, offset: int) -> None:
    libc = _libc()
    assert libc is not None  # callers check supported()
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = libc.mmap(address, nbytes, prot, flags | _MAP_FIXED, fd, offset)
    if got in (None, _MAP_FAILED) or got != address:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap at {address:#x} ({nbytes} bytes): {os.strerror(errno)}")


def map_file_pages(buf: torch.Tensor, first_page: int, pages: int, fd: int, offset: int) -> None:
    """Map ``pages`` pages of file ``fd`` from byte ``offset`` over ``buf``'s pages
    from ``first_page`` (shared: writes on either side are seen by the other).

    The file's contents replace what those pages held.

    Raises:
        OSError: the mapping failed (the pages are left as they were).
    """
    _mmap_fixed(
        buf.data_ptr() + first_page * PAGE_BYTES, pages * PAGE_BYTES, mmap.MAP_SHARED, fd, offset
    )


def unmap_pages(buf: torch.Tensor, first_page: int, pages: int) -> None:
    """Give ``buf``'s pages from ``first_page`` private memory again, keeping their contents.

    Raises:
        OSError: the new mapping failed.
    """
    lo, hi = first_page * PAGE_NUMEL, (first_page + pages) * PAGE_NUMEL
    kept = buf[lo:hi].clone()
    _mmap_fixed(
        buf.data_ptr() + first_page * PAGE_BYTES,
        pages * PAGE_BYTES,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        -1,
        0,
    )
    buf[lo:hi].copy_(kept)
