"""Loom's cache directory, and whether what lies in it may be trusted.

The cache holds what Loom runs or renders without asking: native kernels (code), a GGUF file's
tokenizer and chat template (a template is code too), the default model. Another user who
could write into it would choose all three. So a directory there is used only if nobody else
could have written into it: it and its ancestors owned by this user or root (an image's
read-only cache is root's), it not writable by group or others, and no ancestor letting others
rename it (writable by group or others without the sticky bit that /tmp has). Loom creates
missing directories 0700; a file in a trusted directory is trusted if it, too, is owned by
this user or root and writable by no one else. (worker/kernels/__init__.py applies the same
rules to its libraries with its own copy: it imports nothing beyond the standard library.)
"""

from __future__ import annotations

import os
import stat

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafeCacheError(PermissionError):
    """A cache directory someone else could write into; the message names it and why."""


def cache_root() -> str:
    """$LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom, else ~/.cache/loom."""
    return os.environ.get("LOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loom")


def private_dir(path: str) -> str:
    """`path`, created 0700 (with its missing parents) if absent; UnsafeCacheError if others
    could write into it, OSError if it cannot be created."""
    make_private_dirs(path)
    problem = directory_problem(path)
    if problem is not None:
        raise UnsafeCacheError(f"the cache directory {path} is not private: {problem}; fix "
                               f"that, or set LOOM_CACHE_DIR to a directory of your own")
    return path


def make_private_dirs(path: str) -> None:
    """Create `path` and its missing parents 0700 (os.makedirs's mode covers only the last)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # another process made it meanwhile
            pass


def directory_problem(path: str) -> str | None:
    """Why what is in `path` could have been written by someone else, or None."""
    current = os.path.realpath(path)
    first = True
    while True:
        st = os.stat(current)
        if st.st_uid not in (os.geteuid(), 0):
            return f"{current} is owned by uid {st.st_uid}"
        if st.st_mode & _OTHERS_WRITE and (first or not st.st_mode & stat.S_ISVTX):
            return (f"{current} is writable by group or others (mode "
                    f"{stat.S_IMODE(st.st_mode):o})")
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current, first = parent, False


def contents_problem(path: str) -> str | None:
    """Why a directory Loom wrote in a trusted one (a tokenizer's), or a file or directory
    directly in it, could have been changed by someone else since, or None."""
    for entry in [path, *(e.path for e in os.scandir(path))]:
        st = os.lstat(entry)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return f"{entry} is not a regular file"
        problem = _owner_problem(st)
        if problem is not None:
            return f"{entry} is {problem}"
    return None


def drop_others_write(path: str) -> None:
    """Clear group and other write on the directory `path` and on what is directly in it (what
    a umask such as 002 left), so that a later start trusts what this one wrote."""
    for entry in [path, *(e.path for e in os.scandir(path))]:
        st = os.lstat(entry)
        if st.st_mode & _OTHERS_WRITE and not stat.S_ISLNK(st.st_mode):
            os.chmod(entry, stat.S_IMODE(st.st_mode) & ~_OTHERS_WRITE)


def _owner_problem(st: os.stat_result) -> str | None:
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & _OTHERS_WRITE:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None
