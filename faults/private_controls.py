"""Negative controls of the daemon's private state (kvpool.pool.arena): the layout before it had
a segment of its own. Never the production daemon.

  SharedPrivateArena.anonymous(label, page_size, num_pages)
        the known-bad layout (arena layout 3 and before, in the version 4 format): the
        header, heartbeat, generations and index in the same memfd as the pages, which is
        not sealed against writing, handed to the tenant's clients as both descriptors.
        A client still maps the "private" descriptor PROT_READ, but the memory behind it is
        the page segment every client maps read-write: whoever scribbles over the pages
        writes the index other replicas' probes read, the generations the daemon's stale
        check and scrub trust, and the heartbeat. Plug it in with
        PoolDaemon(config, arena_factory=SharedPrivateArena.anonymous).
  ARENA_CONTROLS   name -> arena factory, for the scenarios and suites that pick one by name.
"""

from __future__ import annotations

import fcntl
import os

from kvpool.pool.arena import ALIGN, SIZE_SEALS, Arena, Layout
from kvpool.errors import ArenaError


class SharedPrivateArena(Arena):
    @classmethod
    def anonymous(cls, label: str, page_size: int, num_pages: int) -> Arena:
        cls.check_geometry(page_size, num_pages)
        private = Layout.new(page_size, num_pages).private_size
        pages_off = (private + ALIGN - 1) // ALIGN * ALIGN
        layout = Layout.new(page_size, num_pages, pages_off=pages_off)
        fd = cls.memfd(label, layout.pages_end)
        try:
            os.pwrite(fd, layout.header(), 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)  # sealed against resizing only, as layout 3 was
            second = os.dup(fd)
        except OSError as exc:
            os.close(fd)
            raise ArenaError(f"cannot format the known-bad segment of {label!r}: {exc}") from exc
        return cls(label, fd, second, writable=True, keep_fds=True)


ARENA_CONTROLS = {"shared_private": SharedPrivateArena.anonymous}
