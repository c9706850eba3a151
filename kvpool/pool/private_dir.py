"""Directories nobody but their owner (and root) can change: the pool daemon's run
directory (its sockets, pid file, tokens) and the checkpoint identity's cache.

A file is only as safe as every directory above it: whoever can write to one of them can
rename what is below and put their own in its place (a run directory with their own
sockets, where tenants then send their tokens). So every component is checked, not the
last one only.

  ensure_private_dir(path, error=InsecureDirectory) -> Path
      walks `path` from / one component at a time with lstat (never following a link it
      has not checked): each must be a directory owned by the caller's effective uid or by
      root, and not writable by group or others unless it has the sticky bit (/tmp: there
      nobody can rename or remove another user's entries). A symbolic link is followed
      only if it is owned by the caller or root (it sits in a directory already checked,
      so nobody else can have put it there unless that directory is sticky, and then it
      is theirs and refused); its target is checked the same way. A component that does
      not exist is created (mkdir, mode 0700) and checked like the others after creating
      it, so a directory someone else created first is refused, not adopted. The last
      component must be the caller's own and is left mode 0700 (group or other read or
      search bits are removed with a warning; group or other write bits are refused:
      something may already have been put inside). Returns the path with the links it
      followed resolved; raises `error` (an InsecureDirectory) naming the offending path
      and the reason.

Contracts: nothing is created outside a directory that passed; no component is chmod-ed
but the last; a refusal changes nothing. Linux semantics (st_uid, the sticky bit).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from kvpool.errors import PoolError

log = logging.getLogger("kvpool.pool.private_dir")

MAX_LINKS = 40  # links followed in one walk (Linux's own limit for a path lookup)


class InsecureDirectory(PoolError):
    """A directory (or a component above it) that someone other than its user or root can
    change: refused, with the path and the reason."""

    what = "directory"  # what was refused, for the message

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{self.what} refused, {path}: {reason}")
        self.path = str(path)
        self.reason = reason


def trusted_uids() -> frozenset[int]:
    """Who may own a directory above a private one: this user and root."""
    return frozenset({os.geteuid(), 0})


def _check_component(path: Path, st: os.stat_result, error: type[InsecureDirectory]) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise error(path, "not a directory")
    if st.st_uid not in trusted_uids():
        raise error(path, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root: "
                          "its owner can replace what is inside")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise error(path, f"mode {stat.S_IMODE(st.st_mode):04o}: writable by group or others without the "
                          "sticky bit, so they can replace what is inside")


def ensure_private_dir(path: str | os.PathLike, *, error: type[InsecureDirectory] = InsecureDirectory) -> Path:
    todo = list(Path(os.path.abspath(path)).parts[1:])
    current = Path("/")
    _check_component(current, os.lstat(current), error)
    links = 0
    while todo:
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":  # every prefix of `current` was checked on the way here
            current = current.parent
            continue
        nxt = current / name
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            try:
                os.mkdir(nxt, 0o700)
            except FileExistsError:
                pass  # created by someone else meanwhile: checked below like any other
            st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in trusted_uids():
                raise error(nxt, f"a symbolic link owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) "
                                 "or root: its owner can point it anywhere")
            links += 1
            if links > MAX_LINKS:
                raise error(path, f"more than {MAX_LINKS} symbolic links")
            target = os.readlink(nxt)
            if os.path.isabs(target):
                current = Path("/")
            todo = [*Path(target).parts[1 if os.path.isabs(target) else 0:], *todo]
            continue
        _check_component(nxt, st, error)
        current = nxt
    st = os.lstat(current)
    if st.st_uid != os.geteuid():
        raise error(current, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise error(current, f"mode {stat.S_IMODE(st.st_mode):04o}: writable by group or others, who may "
                             "already have put something inside")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(current, 0o700)
        log.warning("%s was mode %04o; made 0700", current, stat.S_IMODE(st.st_mode))
    return current
