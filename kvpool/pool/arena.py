"""The data plane of one tenant: two shared-memory segments, its pages and the daemon's
private state (the layout, the generations, the index of committed blocks, the heartbeat).

  Arena.anonymous(label, page_size, num_pages)
        the daemon's: two memfds nobody can open by name, their sizes sealed (a mapper
        cannot shrink them under the daemon): the page segment (`label`) and the private
        segment (`label:private`). The daemon maps both read-write, then seals the private
        one with F_SEAL_FUTURE_WRITE (Linux >= 5.1): the daemon's mapping keeps writing,
        and nobody can write it any other way from then on (a writable shared mapping,
        mprotect to PROT_WRITE, write(2), a hole punched: EPERM / EACCES).
  arena.handout_fds() -> (private, pages)
        the descriptors the daemon hands one tenant's clients (SCM_RIGHTS, kvpool.pool.attach).
  Arena.from_fds(private_fd, pages_fd, label)
        a client maps them (this call owns and closes both): the private segment
        PROT_READ, the pages read-write. Refused unless both are sealed against shrinking.
  Arena.create(name, page_size, num_pages) / Arena.attach(name)
        the same two segments by name in /dev/shm (NAME and NAME.private, mode 0600, O_EXCL),
        for tests and tools on one host; attach maps the private one read-only, but a named
        file has no seal: any process of its owner may open it for writing. The daemon
        uses anonymous segments only.
  arena.page(i)                               a writable numpy view of page i (zero-copy).
  arena.generation(i) / bump_generation(i)    a counter per page, bumped by the daemon
                                              every time the page is freed, so a reader
                                              that held page i across a reuse sees that
                                              the generation moved.
  arena.generations                           the generation array (read-only in a client).
  arena.index_entries                         the index region (kvpool.pool.index.ENTRY
                                              records; read-only in a client).
  arena.beat() / arena.heartbeat_age_s()      the daemon's heartbeat: it writes CLOCK_MONOTONIC
                                              into the private header on a short period; a
                                              same-host client reads how old it is (a
                                              stopped or wedged daemon stops beating).
  arena.private_writable                      whether this mapping of the private segment
                                              is writable (the daemon's, or a named segment's
                                              creator).
  read_layout(buf, private_size, pages_size, name) -> Layout
                                              a private header, checked against the sizes
                                              of the two segments (ArenaError if it does not fit).
  arena.close() / Arena.unlink(name)          unmap; remove named segments.
  arena.closed                                whether it was unmapped.

Layout (version 4). The private segment: a 4 KiB header (magic, layout version, page size,
number of pages, where the generations, the index and the pages are, the instance id, and
at byte 512 the heartbeat: a 64-bit CLOCK_MONOTONIC nanosecond count, 0 until the first
beat), the generation array (uint64 per page), the index of committed blocks
(kvpool.pool.index: the daemon writes it, same-host clients probe it), each part aligned to
4 KiB. The page segment: the pages, from the header's `pages_off` (0: nothing else is in it).

What is trusted where: every byte of the page segment can be written by every client of
the tenant (a client writes the pages it publishes, and could write any other), so nothing
in it is trusted: every loader checks a page against the digest the daemon recorded at
commit (and the scrub re-checks pages at rest). What a client trusts without a digest
(where the pages are, which blocks are committed, the generations, the heartbeat) is in
the private segment, which only the daemon can write. Until layout 3 all of it sat in the
one segment every client mapped read-write: one client could plant index entries that
other replicas' probes trusted, freeze generations (blinding the stale check and the
scrub) or fake a live daemon.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import secrets
import struct
import time
from pathlib import Path

import numpy as np

from kvpool.errors import ArenaError
from kvpool.pool.index import ENTRY, index_bytes

SHM_DIR = Path("/dev/shm")
MAGIC = b"KVGATE\x00\x01"
LAYOUT_VERSION = 4  # 4: the private state in a segment of its own, read-only to clients; 3: two index buckets
HEADER_BYTES = 4096
ALIGN = 4096
# magic, version, page_size, num_pages, gen_off, index_off, index_entries, pages_off, instance
_HEADER = struct.Struct("<8sIQQQQQQ16s")
HEARTBEAT_OFF = 512  # inside the header, past _HEADER; one aligned 64-bit word (a single store on x86)
# Linux >= 5.1 (include/uapi/linux/fcntl.h); Python's fcntl module does not name it.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
PRIVATE_SEALS = SIZE_SEALS | F_SEAL_FUTURE_WRITE  # what the daemon puts on the private segment
PRIVATE_SUFFIX = ":private"  # an anonymous private segment's label: the page segment's plus this
_NAMED_PRIVATE = ".private"  # a named private segment: the page segment's name plus this


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def segment_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ArenaError(f"invalid shared-memory segment name {name!r}")
    return SHM_DIR / name


def segment_label(pool: str, tenant: str) -> str:
    """The label of a daemon's anonymous page segment for `tenant` (seen in /proc/PID/maps);
    its private segment's is this plus PRIVATE_SUFFIX."""
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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where everything is: offsets into the private segment (generations, index) and into
    the page segment (pages)."""

    page_size: int
    num_pages: int
    gen_off: int
    index_off: int
    index_entries: int
    pages_off: int
    instance: bytes

    @classmethod
    def new(cls, page_size: int, num_pages: int, pages_off: int = 0) -> Layout:
        """A fresh layout (a new instance id); `pages_off`: where the pages start in the page segment."""
        index_off = HEADER_BYTES + _align(8 * num_pages)
        return cls(page_size, num_pages, HEADER_BYTES, index_off, index_bytes(num_pages) // ENTRY.itemsize,
                   pages_off, secrets.token_bytes(16))

    @property
    def private_size(self) -> int:
        return self.index_off + _align(self.index_entries * ENTRY.itemsize)

    @property
    def pages_end(self) -> int:
        return self.pages_off + self.page_size * self.num_pages

    def header(self) -> bytes:
        return _HEADER.pack(MAGIC, LAYOUT_VERSION, self.page_size, self.num_pages, self.gen_off, self.index_off,
                            self.index_entries, self.pages_off, self.instance)


def read_layout(buf, private_size: int, pages_size: int, name: str) -> Layout:  # noqa: ANN001 - a buffer
    """The layout a private segment's header describes, checked against the two segments' sizes."""
    if private_size < HEADER_BYTES:
        raise ArenaError(f"segment {name!r}: its private segment is too small ({private_size} bytes)")
    magic, version = struct.unpack_from("<8sI", buf, 0)
    if magic != MAGIC:
        raise ArenaError(f"segment {name!r} is not a kvgate arena (magic {magic!r})")
    if version != LAYOUT_VERSION:
        raise ArenaError(f"segment {name!r} has arena layout {version}, this build reads {LAYOUT_VERSION}")
    _, _, *fields = _HEADER.unpack_from(buf, 0)
    layout = Layout(*fields)
    if (layout.page_size <= 0 or layout.num_pages <= 0 or layout.gen_off < HEADER_BYTES
            or layout.gen_off + 8 * layout.num_pages > layout.index_off
            or layout.index_off + ENTRY.itemsize * layout.index_entries > private_size
            or layout.pages_off % ALIGN or layout.pages_end > pages_size):
        raise ArenaError(f"segment {name!r}: its header claims {layout.num_pages} pages of {layout.page_size} "
                         f"at {layout.pages_off} of a page segment of {pages_size} bytes, an index of "
                         f"{layout.index_entries} entries in a private segment of {private_size}")
    return layout


def _seals(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


class Arena:
    """A mapped arena. Not thread-safe by itself; the daemon's catalog arbitrates pages.

    Arena(name, private_fd, pages_fd, writable=, keep_fds=) maps what it is given (and
    closes the descriptors unless `keep_fds`); the classmethods are how one is made."""

    def __init__(self, name: str, private_fd: int, pages_fd: int, *, writable: bool, keep_fds: bool = False):
        self.name = name
        self._fds: tuple[int, int] | None = (private_fd, pages_fd)
        self._pmap: mmap.mmap | None = None
        self._mmap: mmap.mmap | None = None
        try:
            private_size = os.fstat(private_fd).st_size
            pages_size = os.fstat(pages_fd).st_size
            if private_size < HEADER_BYTES or pages_size <= 0:
                raise ArenaError(f"segment {name!r}: a private segment of {private_size} bytes and a page "
                                 f"segment of {pages_size} bytes cannot be an arena")
            prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
            self._pmap = mmap.mmap(private_fd, private_size, flags=mmap.MAP_SHARED, prot=prot)
            layout = read_layout(self._pmap, private_size, pages_size, name)
            self._mmap = mmap.mmap(pages_fd, pages_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, ArenaError) as exc:
            for m in (self._pmap, self._mmap):
                if m is not None:
                    m.close()
            self._close_fds()
            if isinstance(exc, ArenaError):
                raise
            raise ArenaError(f"cannot map segment {name!r}: {exc}") from exc
        if not keep_fds:
            self._close_fds()
        self.layout = layout
        self.private_writable = writable
        self.page_size: int = layout.page_size
        self.num_pages: int = layout.num_pages
        self.instance: bytes = layout.instance
        self._pages_off = layout.pages_off
        self.size = private_size + pages_size
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        self._private = np.frombuffer(self._pmap, dtype=np.uint8)
        self.generations = np.frombuffer(self._pmap, dtype=np.uint64, count=layout.num_pages, offset=layout.gen_off)
        self.index_entries = np.frombuffer(self._pmap, dtype=ENTRY, count=layout.index_entries,
                                           offset=layout.index_off)
        self._beat = np.frombuffer(self._pmap, dtype=np.uint64, count=1, offset=HEARTBEAT_OFF)

    # -- lifecycle ---------------------------------------------------------------------
    @staticmethod
    def private_size(num_pages: int) -> int:
        return Layout.new(1, num_pages).private_size

    @staticmethod
    def total_size(page_size: int, num_pages: int) -> int:
        """Bytes of both segments together."""
        return Arena.private_size(num_pages) + page_size * num_pages

    @staticmethod
    def check_geometry(page_size: int, num_pages: int) -> None:
        if page_size <= 0 or page_size % 64:
            raise ArenaError(f"page_size must be a positive multiple of 64, got {page_size}")
        if num_pages <= 0:
            raise ArenaError(f"num_pages must be positive, got {num_pages}")

    @staticmethod
    def memfd(label: str, size: int) -> int:
        """A sealable memfd of `size` bytes, its memory allocated (ArenaError if it cannot be)."""
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ArenaError(f"cannot create an anonymous segment for {label!r}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            raise ArenaError(f"cannot size the segment of {label!r} to {size} bytes: {exc}") from exc
        return fd

    @classmethod
    def anonymous(cls, label: str, page_size: int, num_pages: int) -> Arena:
        """The daemon's two segments (see the module's docstring); the arena keeps their
        descriptors (handout_fds()) to hand to the processes meant to map them."""
        cls.check_geometry(page_size, num_pages)
        layout = Layout.new(page_size, num_pages)
        pages_fd = cls.memfd(label, page_size * num_pages)
        try:
            private_fd = cls.memfd(label + PRIVATE_SUFFIX, layout.private_size)
        except ArenaError:
            os.close(pages_fd)
            raise
        try:
            os.pwrite(private_fd, layout.header(), 0)
            fcntl.fcntl(pages_fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        except OSError as exc:
            os.close(private_fd)
            os.close(pages_fd)
            raise ArenaError(f"cannot format and seal the segments of {label!r}: {exc}") from exc
        arena = cls(label, private_fd, pages_fd, writable=True, keep_fds=True)
        try:  # after the daemon's own writable mapping: the only one there will ever be
            fcntl.fcntl(private_fd, fcntl.F_ADD_SEALS, PRIVATE_SEALS)
        except OSError as exc:
            arena.close()
            raise ArenaError(f"cannot seal the private segment of {label!r} against writing by its clients "
                             f"(F_SEAL_FUTURE_WRITE needs Linux >= 5.1): {exc}") from exc
        return arena

    @classmethod
    def from_fds(cls, private_fd: int, pages_fd: int, label: str) -> Arena:
        """Map segments handed over as descriptors (which this call owns and closes): the
        private one read-only. Refused unless both are sealed against shrinking: a segment
        its other mappers could shrink would fault this process on its next access."""
        try:
            seals = (_seals(private_fd), _seals(pages_fd))
        except OSError as exc:
            for fd in {private_fd, pages_fd}:
                os.close(fd)
            raise ArenaError(f"segment {label!r} handed over is not a sealed memfd: {exc}") from exc
        if not all(s & fcntl.F_SEAL_SHRINK for s in seals):
            for fd in {private_fd, pages_fd}:
                os.close(fd)
            raise ArenaError(f"segment {label!r} handed over is not sealed against shrinking "
                             f"(seals {seals[0]:#x} private, {seals[1]:#x} pages)")
        return cls(label, private_fd, pages_fd, writable=False)

    def handout_fds(self) -> tuple[int, int]:
        """The descriptors of the private and the page segment, kept by an arena made with
        `anonymous`: what the daemon hands a client (the private one sealed read-only)."""
        if self._fds is None:
            raise ArenaError(f"arena {self.name!r} keeps no descriptors")
        return self._fds

    def _close_fds(self) -> None:
        if self._fds is not None:
            for fd in set(self._fds):
                os.close(fd)
            self._fds = None

    @classmethod
    def create(cls, name: str, page_size: int, num_pages: int) -> Arena:
        cls.check_geometry(page_size, num_pages)
        layout = Layout.new(page_size, num_pages)
        paths = (segment_path(name + _NAMED_PRIVATE), segment_path(name))
        fds: list[int] = []
        try:
            for path, size in zip(paths, (layout.private_size, layout.pages_end)):
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
                os.ftruncate(fds[-1], size)
                os.posix_fallocate(fds[-1], 0, size)
            os.pwrite(fds[0], layout.header(), 0)
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            for path in paths[: len(fds)]:
                path.unlink(missing_ok=True)
            if isinstance(exc, FileExistsError):
                raise ArenaExists(f"shared-memory segment {name!r} already exists") from exc
            raise ArenaError(f"cannot create shared-memory segment {name!r}: {exc}") from exc
        return cls(name, fds[0], fds[1], writable=True)

    @classmethod
    def attach(cls, name: str) -> Arena:
        fds: list[int] = []
        try:
            fds.append(os.open(segment_path(name + _NAMED_PRIVATE), os.O_RDONLY))
            fds.append(os.open(segment_path(name), os.O_RDWR))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            if isinstance(exc, FileNotFoundError):
                raise ArenaError(f"shared-memory segment {name!r} does not exist") from exc
            raise ArenaError(f"cannot open shared-memory segment {name!r}: {exc}") from exc
        return cls(name, fds[0], fds[1], writable=False)

    @staticmethod
    def exists(name: str) -> bool:
        return segment_path(name).exists()

    @staticmethod
    def unlink(name: str) -> bool:
        """Remove the named segments; True if there was one."""
        found = False
        for path in (segment_path(name), segment_path(name + _NAMED_PRIVATE)):
            try:
                path.unlink()
                found = True
            except FileNotFoundError:
                pass
        return found

    @property
    def closed(self) -> bool:
        """Whether either mapping is gone (closed: nothing of it may be read)."""
        return self._mmap.closed or self._pmap.closed

    def close(self) -> None:
        """Unmap (and close kept descriptors). Views handed out by `page()` must be dropped first."""
        self._close_fds()
        if self._mmap.closed and self._pmap.closed:
            return
        self._bytes = self._private = None  # type: ignore[assignment]
        self.generations = self.index_entries = self._beat = None  # type: ignore[assignment]
        held = []
        for m in (self._mmap, self._pmap):
            try:
                m.close()
            except BufferError as exc:
                held.append(str(exc))
        if held:
            raise ArenaError(f"arena {self.name!r} still has views in use: {'; '.join(held)}")

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

    # -- the private state -------------------------------------------------------------
    def generation(self, page_id: int) -> int:
        self._check(page_id)
        return int(self.generations[page_id])

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
        self.generations[page_id] += np.uint64(1)
        return int(self.generations[page_id])


class ArenaExists(ArenaError):
    """The segment name is taken (a live daemon, or one that crashed)."""
