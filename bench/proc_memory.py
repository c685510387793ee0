"""Resident memory of a server process and its descendants, from /proc (Linux only).

For the soak test: which processes make up a running loom (the API server, its worker,
scheduler and multiprocessing resource_tracker), and their VmRSS now. The worker's KV cache is
one big zero-filled anonymous mapping whose pages become resident only when a block is first
written, so its RSS grows with the blocks the scheduler has handed out so far, which is not a
leak; `kv_rss_kb` reports that mapping's resident part separately.
"""

from __future__ import annotations

import os

from bench.procs import read_text, stat

KB = 1024


def descendants(root: int) -> list[int]:
    """`root`'s children, grandchildren, ... (not `root` itself), oldest first."""
    parents: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        info = stat(int(name))
        if info is not None:
            parents.setdefault(info[0], []).append(int(name))
            started[int(name)] = info[1]
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return sorted(found, key=lambda pid: (started.get(pid, 0), pid))


def cmdline(pid: int) -> str:
    text = read_text(f"/proc/{pid}/cmdline") or ""
    return text.replace("\0", " ").strip()


def roles(root: int, pids: list[int]) -> dict[int, str]:
    """What each loom process is: the API server (root), multiprocessing's resource_tracker,
    the worker and the scheduler. Of the spawned children, the worker is the one with the
    largest address space (it maps the weights and the whole KV cache, resident or not; both
    children may import torch, so mapping libtorch tells nothing); the others are called
    scheduler."""
    out: dict[int, str] = {}
    spawned = []
    for pid in pids:
        if pid == root:
            out[pid] = "api-server"
            continue
        cmd = cmdline(pid)
        if "resource_tracker" in cmd:
            out[pid] = "resource-tracker"
        elif "multiprocessing.spawn" in cmd or "--multiprocessing-fork" in cmd:
            spawned.append(pid)
        else:
            out[pid] = "child:" + ((read_text(f"/proc/{pid}/comm") or "?").strip())
    if spawned:
        sizes = {pid: status_kb(pid).get("VmSize", 0) for pid in spawned}
        worker = max(spawned, key=lambda pid: sizes[pid])
        for pid in spawned:
            out[pid] = "worker" if pid == worker else "scheduler"
    return out


def status_kb(pid: int) -> dict[str, int]:
    """VmSize, VmRSS, VmHWM, RssAnon, RssFile (kB) and Threads of /proc/<pid>/status."""
    values = {}
    for line in (read_text(f"/proc/{pid}/status") or "").splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmSize", "VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"):
            try:
                values[key] = int(rest.split()[0])
            except (IndexError, ValueError):
                pass
    return values


def anonymous_mappings(pid: int) -> list[tuple[int, int]]:
    """(size kB, resident kB) of every anonymous, unnamed mapping of `pid` (from smaps)."""
    out: list[tuple[int, int]] = []
    size = None
    anonymous = False
    for line in (read_text(f"/proc/{pid}/smaps") or "").splitlines():
        first = line.split(None, 1)[0] if line else ""
        if "-" in first and not first.endswith(":"):
            parts = line.split()
            anonymous = len(parts) < 6  # no path, no [heap]/[stack] tag
            size = None
        elif first == "Size:":
            size = int(line.split()[1])
        elif first == "Rss:" and anonymous and size is not None:
            out.append((size, int(line.split()[1])))
    return out


def kv_mapping_rss_kb(pid: int, kv_bytes: int | None) -> tuple[int, int] | None:
    """(size kB, resident kB) of the worker's KV cache mapping: the anonymous mapping whose
    size is within 3 % of `kv_bytes` (the size the server logged), else the largest anonymous
    mapping of 1 GiB or more; None when there is no such mapping."""
    maps = anonymous_mappings(pid)
    if not maps:
        return None
    if kv_bytes:
        want = kv_bytes / KB
        close = [m for m in maps if abs(m[0] - want) <= 0.03 * want]
        if close:
            return min(close, key=lambda m: abs(m[0] - want))
    biggest = max(maps)
    return biggest if biggest[0] >= (1 << 20) else None


def snapshot(root: int, kv_bytes: int | None = None) -> list[dict]:
    """One row per live process of the tree rooted at `root` (root first)."""
    rows = []
    pids = [root] + descendants(root)
    names = roles(root, pids)
    for pid in pids:
        status = status_kb(pid)
        if "VmRSS" not in status:
            continue  # gone, or a zombie
        row = {"pid": pid, "role": names[pid], "rss_kb": status["VmRSS"],
               "hwm_kb": status.get("VmHWM"), "anon_kb": status.get("RssAnon"),
               "threads": status.get("Threads")}
        if row["role"] == "worker":
            kv = kv_mapping_rss_kb(pid, kv_bytes)
            if kv is not None:
                row["kv_mapping_kb"], row["kv_rss_kb"] = kv
                row["rss_excl_kv_kb"] = row["rss_kb"] - kv[1]
        rows.append(row)
    return rows
