"""Processes, from /proc (Linux only): the process table with each one's CPU time, process
trees, and who listens on a TCP port. Shared by the interference monitor, the servers the
harness starts, and the soak's memory readings."""

from __future__ import annotations

import os

TICKS = os.sysconf("SC_CLK_TCK")


def read_text(path: str) -> str | None:
    """A /proc file's text, or None when it is gone (or not ours to read)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of `pid`, or None when it is gone."""
    text = read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19])


def read_procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime in clock ticks), for every process we can read."""
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        procs[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return procs


def in_tree(pid: int, procs: dict, roots: set[int]) -> bool:
    """Whether `pid` is one of `roots` or descends from one (`procs` from read_procs())."""
    while pid > 1 and pid in procs:
        if pid in roots:
            return True
        pid = procs[pid][0]
    return False


def listening_pid(port: int) -> int | None:
    """The process holding the listening TCP socket on `port` on this machine (the oldest
    holder, when a child inherited it); None when there is none, or it is not ours to see."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (read_text(table) or "").splitlines()[1:]:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])  # state 0A: LISTEN
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    holders = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") in targets:
                    holders.append(int(name))
                    break
            except OSError:
                continue  # this fd closed meanwhile; the process's others still count
    if not holders:
        return None
    # An inheriting child's parent holds it too: the holder whose parent does not.
    holder_set = set(holders)
    roots = [pid for pid in holders if (stat(pid) or (0, 0))[0] not in holder_set]
    return min(roots or holders)
