"""The data plane: a POSIX shared-memory arena of fixed-size pages.

  Arena.create(name, page_size, num_pages)   the daemon makes the segment (O_EXCL).
  Arena.attach(name)                          a client on the same host maps it.
  arena.page(i)                               a writable numpy view of page i (zero-copy).
  arena.generation(i) / bump_generation(i)    a counter per page, bumped by the daemon
                                              every time the page is freed, so a reader
                                              that held page i across a reuse sees that
                                              the generation moved.
  arena.close() / Arena.unlink(name)          unmap; remove the segment.

Layout: a 4 KiB header (magic, layout version, geometry, instance id), the generation
array (uint64 per page), then the pages, each aligned to 4 KiB. The segment lives in
/dev/shm, so it is shared by every process on the host and survives a crashed daemon
(the next daemon finds it, says so, and starts clean).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from pathlib import Path

import numpy as np

from kvpool.errors import ArenaError

SHM_DIR = Path("/dev/shm")
MAGIC = b"KVGATE\x00\x01"
LAYOUT_VERSION = 1
HEADER_BYTES = 4096
ALIGN = 4096
_HEADER = struct.Struct("<8sIQQQQ16s")  # magic, version, page_size, num_pages, gen_off, pages_off, instance


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def segment_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ArenaError(f"invalid shared-memory segment name {name!r}")
    return SHM_DIR / name


class Arena:
    """A mapped arena. Not thread-safe by itself; the daemon's catalog arbitrates pages."""

    def __init__(self, name: str, fd: int, size: int):
        self.name = name
        try:
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, page_size, num_pages, gen_off, pages_off, instance = _HEADER.unpack_from(self._mmap, 0)
        if magic != MAGIC:
            self._mmap.close()
            raise ArenaError(f"segment {name!r} is not a kvgate arena (magic {magic!r})")
        if version != LAYOUT_VERSION:
            self._mmap.close()
            raise ArenaError(f"segment {name!r} has arena layout {version}, this build reads {LAYOUT_VERSION}")
        self.page_size: int = page_size
        self.num_pages: int = num_pages
        self.instance: bytes = instance
        self._pages_off = pages_off
        self.size = size
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        self._gens = np.frombuffer(self._mmap, dtype=np.uint64, count=num_pages, offset=gen_off)

    # -- lifecycle ---------------------------------------------------------------------
    @staticmethod
    def total_size(page_size: int, num_pages: int) -> int:
        return HEADER_BYTES + _align(8 * num_pages) + page_size * num_pages

    @classmethod
    def create(cls, name: str, page_size: int, num_pages: int) -> Arena:
        if page_size <= 0 or page_size % 64:
            raise ArenaError(f"page_size must be a positive multiple of 64, got {page_size}")
        if num_pages <= 0:
            raise ArenaError(f"num_pages must be positive, got {num_pages}")
        path = segment_path(name)
        size = cls.total_size(page_size, num_pages)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise ArenaExists(f"shared-memory segment {name!r} already exists") from exc
        except OSError as exc:
            raise ArenaError(f"cannot create shared-memory segment {name!r}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ArenaError(f"cannot size segment {name!r} to {size} bytes: {exc}") from exc
        header = _HEADER.pack(MAGIC, LAYOUT_VERSION, page_size, num_pages, HEADER_BYTES,
                              HEADER_BYTES + _align(8 * num_pages), secrets.token_bytes(16))
        os.pwrite(fd, header, 0)
        return cls(name, fd, size)

    @classmethod
    def attach(cls, name: str) -> Arena:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise ArenaError(f"shared-memory segment {name!r} does not exist") from exc
        except OSError as exc:
            raise ArenaError(f"cannot open shared-memory segment {name!r}: {exc}") from exc
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            os.close(fd)
            raise ArenaError(f"segment {name!r} is too small ({size} bytes) to be an arena")
        return cls(name, fd, size)

    @staticmethod
    def exists(name: str) -> bool:
        return segment_path(name).exists()

    @staticmethod
    def unlink(name: str) -> bool:
        """Remove the segment; True if there was one."""
        try:
            segment_path(name).unlink()
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        """Unmap. Views handed out by `page()` must be dropped first."""
        if self._mmap.closed:
            return
        self._bytes = None  # type: ignore[assignment]
        self._gens = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError as exc:
            raise ArenaError(f"arena {self.name!r} still has views in use: {exc}") from exc

    @property
    def closed(self) -> bool:
        return self._mmap.closed

    # -- pages -------------------------------------------------------------------------
    def _check(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ArenaError(f"page {page_id} outside arena of {self.num_pages} pages")

    def page(self, page_id: int, length: int | None = None) -> np.ndarray:
        """A writable uint8 view of page `page_id` (its first `length` bytes)."""
        self._check(page_id)
        n = self.page_size if length is None else length
        if not 0 <= n <= self.page_size:
            raise ArenaError(f"length {n} outside page size {self.page_size}")
        start = self._pages_off + page_id * self.page_size
        return self._bytes[start : start + n]

    def page_address(self, page_id: int) -> int:
        """The virtual address of page `page_id` in this process (for DMA copies)."""
        self._check(page_id)
        return self._bytes.ctypes.data + self._pages_off + page_id * self.page_size

    @property
    def pages_region(self) -> np.ndarray:
        """All pages as one view (what a GPU host-registers)."""
        return self._bytes[self._pages_off : self._pages_off + self.page_size * self.num_pages]

    def generation(self, page_id: int) -> int:
        self._check(page_id)
        return int(self._gens[page_id])

    def bump_generation(self, page_id: int) -> int:
        self._check(page_id)
        self._gens[page_id] += np.uint64(1)
        return int(self._gens[page_id])


class ArenaExists(ArenaError):
    """The segment name is taken (a live daemon, or one that crashed)."""
