"""The data plane: a POSIX shared-memory arena of fixed-size pages.

  Arena.create(name, page_size, num_pages)   a named segment in /dev/shm (O_EXCL).
  Arena.attach(name)                          a process on the same host maps it by name.
  Arena.anonymous(label, page_size, num_pages)
                                              a sealed memfd: no name anyone can open, its
                                              size fixed (a mapper cannot shrink it under
                                              the daemon); the daemon hands its descriptor
                                              (arena.fileno()) to one tenant's clients only.
  Arena.from_fd(fd, label)                    a client maps a segment it was handed.
  arena.page(i)                               a writable numpy view of page i (zero-copy).
  arena.generation(i) / bump_generation(i)    a counter per page, bumped by the daemon
                                              every time the page is freed, so a reader
                                              that held page i across a reuse sees that
                                              the generation moved.
  arena.index_entries                         the index region (kvpool.shm_index.ENTRY records).
  arena.beat() / arena.heartbeat_age_s()      the daemon's heartbeat: it writes CLOCK_MONOTONIC
                                              into the header on a short period; a
                                              same-host client reads how old it is (a
                                              stopped or wedged daemon stops beating).
  arena.close() / Arena.unlink(name)          unmap; remove the segment.

Layout: a 4 KiB header (magic, layout version, geometry, instance id, where the index is,
and at byte 512 the heartbeat: a 64-bit CLOCK_MONOTONIC nanosecond count, 0 until the first beat),
the generation array (uint64 per page), the index of committed blocks
(kvpool.shm_index: the daemon writes it, same-host clients probe it), then the pages,
each part aligned to 4 KiB. The segment lives in
/dev/shm, so it is shared by every process on the host and survives a crashed daemon
(the next daemon finds it, says so, and starts clean). The daemon's own segments are
anonymous: each tenant's lives only in the processes it was handed to, and its memory
goes back to the kernel when the last of them unmaps it (a crashed daemon leaves none).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import time
from pathlib import Path

import numpy as np

from kvpool.errors import ArenaError
from kvpool.shm_index import ENTRY, index_bytes

SHM_DIR = Path("/dev/shm")
MAGIC = b"KVGATE\x00\x01"
LAYOUT_VERSION = 3  # 3: the index's blocks in either of two buckets
HEADER_BYTES = 4096
ALIGN = 4096
# magic, version, page_size, num_pages, gen_off, pages_off, instance, index_off, index_entries
_HEADER = struct.Struct("<8sIQQQQ16sQQ")
HEARTBEAT_OFF = 512  # inside the header, past _HEADER; one aligned 64-bit word (a single store on x86)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def segment_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ArenaError(f"invalid shared-memory segment name {name!r}")
    return SHM_DIR / name


def segment_label(pool: str, tenant: str) -> str:
    """The label of a daemon's anonymous segment for `tenant` (seen in /proc/PID/maps)."""
    return f"kvgate:{pool}:{tenant}"


def processes_mapping(label_prefix: str) -> dict[int, list[str]]:
    """Every process of this host (that this user may inspect) mapping an anonymous
    segment whose label starts with `label_prefix`: pid -> the labels it maps. How to see
    that a segment is gone: its memory is freed once no process maps it."""
    found: dict[int, list[str]] = {}
    marker = f"/memfd:{label_prefix}"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited or is not ours to read
            continue
        labels = sorted({line.split("/memfd:", 1)[1].removesuffix(" (deleted)")
                         for line in text.splitlines() if marker in line})
        if labels:
            found[int(maps.parent.name)] = labels
    return found


def memory_available() -> int:
    """Bytes of memory the kernel can give without swapping (MemAvailable): what bounds an
    anonymous segment (it is not limited by /dev/shm's size)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ArenaError("/proc/meminfo has no MemAvailable line")


class Arena:
    """A mapped arena. Not thread-safe by itself; the daemon's catalog arbitrates pages."""

    def __init__(self, name: str, fd: int, size: int, keep_fd: bool = False):
        self.name = name
        self._fd: int | None = None
        try:
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise ArenaError(f"cannot map segment {name!r} ({size} bytes): {exc}") from exc
        if keep_fd:
            self._fd = fd
        else:
            os.close(fd)
        magic, version = struct.unpack_from("<8sI", self._mmap, 0)
        problem = None
        if magic != MAGIC:
            problem = f"segment {name!r} is not a kvgate arena (magic {magic!r})"
        elif version != LAYOUT_VERSION:
            problem = f"segment {name!r} has arena layout {version}, this build reads {LAYOUT_VERSION}"
        else:
            (_, _, page_size, num_pages, gen_off, pages_off, instance, index_off,
             index_entries) = _HEADER.unpack_from(self._mmap, 0)
            if (pages_off + page_size * num_pages > size or gen_off + 8 * num_pages > index_off
                    or index_off + ENTRY.itemsize * index_entries > pages_off):
                problem = f"segment {name!r} is {size} bytes, its header claims {num_pages} pages of {page_size}"
        if problem is not None:
            self._mmap.close()
            self._close_fd()
            raise ArenaError(problem)
        self.page_size: int = page_size
        self.num_pages: int = num_pages
        self.instance: bytes = instance
        self._pages_off = pages_off
        self.size = size
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        self._gens = np.frombuffer(self._mmap, dtype=np.uint64, count=num_pages, offset=gen_off)
        self.index_entries = np.frombuffer(self._mmap, dtype=ENTRY, count=index_entries, offset=index_off)
        self._beat = np.frombuffer(self._mmap, dtype=np.uint64, count=1, offset=HEARTBEAT_OFF)

    # -- lifecycle ---------------------------------------------------------------------
    @staticmethod
    def total_size(page_size: int, num_pages: int) -> int:
        return HEADER_BYTES + _align(8 * num_pages) + _align(index_bytes(num_pages)) + page_size * num_pages

    @staticmethod
    def _check_geometry(page_size: int, num_pages: int) -> None:
        if page_size <= 0 or page_size % 64:
            raise ArenaError(f"page_size must be a positive multiple of 64, got {page_size}")
        if num_pages <= 0:
            raise ArenaError(f"num_pages must be positive, got {num_pages}")

    @staticmethod
    def _format(fd: int, page_size: int, num_pages: int) -> None:
        index_off = HEADER_BYTES + _align(8 * num_pages)
        pages_off = index_off + _align(index_bytes(num_pages))
        header = _HEADER.pack(MAGIC, LAYOUT_VERSION, page_size, num_pages, HEADER_BYTES, pages_off,
                              secrets.token_bytes(16), index_off, index_bytes(num_pages) // ENTRY.itemsize)
        os.pwrite(fd, header, 0)

    @classmethod
    def anonymous(cls, label: str, page_size: int, num_pages: int) -> Arena:
        """A segment nobody can open by name: a memfd, its size sealed once set. The
        arena keeps its descriptor (fileno()) to hand to the processes meant to map it."""
        cls._check_geometry(page_size, num_pages)
        size = cls.total_size(page_size, num_pages)
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ArenaError(f"cannot create an anonymous segment for {label!r}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            cls._format(fd, page_size, num_pages)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            os.close(fd)
            raise ArenaError(f"cannot size and seal the segment of {label!r} ({size} bytes): {exc}") from exc
        return cls(label, fd, size, keep_fd=True)

    @classmethod
    def from_fd(cls, fd: int, label: str) -> Arena:
        """Map a segment handed over as a descriptor (which this call owns and closes).
        Refused unless it is sealed against shrinking: a segment its other mappers could
        shrink would fault this process on its next access."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise ArenaError(f"segment {label!r} handed over is not a sealed memfd: {exc}") from exc
        if not seals & fcntl.F_SEAL_SHRINK or size < HEADER_BYTES:
            os.close(fd)
            raise ArenaError(f"segment {label!r} handed over is not sealed against shrinking or too small "
                             f"({size} bytes, seals {seals:#x})")
        return cls(label, fd, size)

    def fileno(self) -> int:
        """The segment's descriptor, kept by an arena made with `anonymous`."""
        if self._fd is None:
            raise ArenaError(f"arena {self.name!r} keeps no descriptor")
        return self._fd

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @classmethod
    def create(cls, name: str, page_size: int, num_pages: int) -> Arena:
        cls._check_geometry(page_size, num_pages)
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
        cls._format(fd, page_size, num_pages)
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
        """Unmap (and close a kept descriptor). Views handed out by `page()` must be dropped first."""
        self._close_fd()
        if self._mmap.closed:
            return
        self._bytes = None  # type: ignore[assignment]
        self._gens = None  # type: ignore[assignment]
        self.index_entries = None  # type: ignore[assignment]
        self._beat = None  # type: ignore[assignment]
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

    def beat(self, now_ns: int | None = None) -> None:
        """The daemon: the heartbeat is now (CLOCK_MONOTONIC, the same clock in every process
        of the host)."""
        self._beat[0] = time.monotonic_ns() if now_ns is None else now_ns

    def heartbeat_age_s(self) -> float | None:
        """Seconds since the daemon's last beat; None if it never beat (a daemon that does
        not beat, or a segment that is not a daemon's)."""
        beat = int(self._beat[0])
        return None if beat == 0 else max(0.0, (time.monotonic_ns() - beat) / 1e9)

    def bump_generation(self, page_id: int) -> int:
        self._check(page_id)
        self._gens[page_id] += np.uint64(1)
        return int(self._gens[page_id])


class ArenaExists(ArenaError):
    """The segment name is taken (a live daemon, or one that crashed)."""
