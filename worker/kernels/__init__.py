"""Small native kernels, built on first use with the system C compiler and loaded with ctypes.

No torch headers, so a build takes about a second; the library is cached by source hash and
target CPU. Without a compiler, callers fall back to the portable PyTorch path.

A cached library is code this process will run, so it is only loaded from a directory nobody
else can write into: loom creates its cache directories 0700, and refuses (with a warning) a
library not owned by this user (or root), writable by group or others, or in a directory that
group or others can write (the rules of pipelines/checkpoint/cache_dirs.py, kept here too: this
module imports nothing beyond the standard library); it then builds a fresh copy in a private
temporary directory. The library is checked through the file descriptor it is then
loaded from (/proc/self/fd), so what runs is what was checked, whatever happens to its path.

`LOOM_KERNEL_MARCH` (default `native`) is the `-march` the kernels are built for: an image
builds them once for a stated baseline (e.g. `x86-64-v3`) and ships them without a compiler;
on a CPU below that baseline they are rebuilt for the CPU at hand (or PyTorch runs).
`LOOM_KERNEL_CFLAGS` (default empty) is appended to the compiler's flags, so it wins over them:
`-O0 -g` to step through a kernel in gdb, `-fsanitize=address`, or `-O1` where the build's
time matters more than the kernels' speed (the packaging test). The flags are part of the
cache key: such a build is never mistaken for the default one.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import time

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_loaded: dict[tuple[str, tuple[str, ...]], ctypes.CDLL | None] = {}
# How each library of this process was obtained ("cached", "built") or why it is missing:
# what the start-up log line (`startup_summary`) reports.
_outcomes: dict[tuple[str, tuple[str, ...]], str] = {}
_build_seconds = [0.0]
_places: set[str] = set()  # the directories the loaded libraries came from
_private_dir: list[str] = []
_library_fds: list[int] = []  # the loaded libraries' descriptors (see _load_from)
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_warned: set[str] = set()

# The CPU flags (as /proc/cpuinfo names them) each x86-64 micro-architecture level needs: a
# library built for a level must not be loaded on a CPU without them (SIGILL mid-request).
_X86_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_MARCH_FLAGS = {"x86-64": set(), "x86-64-v2": _X86_V2, "x86-64-v3": _X86_V3,
                "x86-64-v4": _X86_V4}


def _cache_dir() -> str:
    base = os.environ.get("LOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loom")
    return os.path.join(base, "kernels")


def load_kernel(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library for `name`.c (with `-D` for each of `defines`), or None if it
    cannot be built here."""
    key = (name, defines)
    if key in _loaded:
        return _loaded[key]
    if os.environ.get("LOOM_DISABLE_KERNELS"):
        _loaded[key] = None
        _outcomes[key] = "disabled by LOOM_DISABLE_KERNELS"
        return None
    march = _target_march()
    # Every source of the directory is part of the key (a kernel may #include another), and
    # so is the target: -march=native code built on another CPU (a shared home directory)
    # could use instructions this one lacks.
    extra = _extra_cflags()  # (none: the key of every default build so far, unchanged)
    digest = hashlib.sha256(_sources_digest() + _target_identity(march) + repr(defines).encode()
                            + (repr(extra).encode() if extra else b""))
    filename = f"{name}-{digest.hexdigest()[:16]}.so"
    try:
        target = os.path.join(_library_dir(), filename)
        try:
            fd = _open_trusted(target)
        except _Untrusted as exc:
            logger.warning("refusing cached native kernel %s: %s; rebuilding it in a private "
                           "directory", target, exc)
            target, fd = os.path.join(_private_build_dir(), filename), None
        if fd is not None:
            _outcomes[key] = "cached"
        else:
            if not os.access(os.path.dirname(target), os.W_OK | os.X_OK):
                # A read-only cache (an image's prebuilt kernels on a read-only root file
                # system) that lacks this one: build it privately.
                target = os.path.join(_private_build_dir(), filename)
            started = time.monotonic()
            # (Seconds to minutes per kernel on a small machine, once: say so while it runs.)
            with _progress(f"compiling native kernel {name} (first start only)"):
                _compile(os.path.join(_HERE, f"{name}.c"), target, defines, march)
            _build_seconds[0] += time.monotonic() - started
            _outcomes[key] = "built"
            fd = _open_trusted(target)
            if fd is None:
                raise OSError(f"{target} vanished as it was built")
        _loaded[key] = _load_from(fd, target)
        _places.add(os.path.dirname(target))
    except (OSError, subprocess.CalledProcessError, _Untrusted) as exc:
        # (Reported once for all kernels by `startup_summary`: one line, not one per kernel.)
        reason = _failure_reason(exc)
        logger.debug("native kernel %s unavailable (%s); using the PyTorch path", name, reason)
        _outcomes[key] = reason
        _loaded[key] = None
    return _loaded[key]


def startup_summary() -> tuple[int, str]:
    """(log level, one line) saying which native kernels this process runs and where they came
    from, or why it runs PyTorch's path instead."""
    if not _outcomes:
        return logging.INFO, "native kernels: none used"
    failed = {name: why for (name, _), why in _outcomes.items() if why not in ("cached", "built")}
    if len(failed) == len(_outcomes):
        level = logging.INFO if os.environ.get("LOOM_DISABLE_KERNELS") else logging.WARNING
        return level, f"native kernels: fallback to PyTorch: {_first(failed)}"
    built = sum(why == "built" for why in _outcomes.values())
    cached = sum(why == "cached" for why in _outcomes.values())
    simd = _gemm_simd()
    parts = [f"packed GEMM {simd}"] if simd else []
    if built:
        parts.append(f"{built} built in {_build_seconds[0]:.1f}s")
    if cached:
        parts.append(f"{cached} loaded from cache")
    flags = " ".join([f"-march={_target_march()}", *_extra_cflags()])
    line = f"native kernels: {', '.join(parts)} ({flags}, in {' and '.join(sorted(_places))})"
    if failed:
        return logging.WARNING, (f"{line}; fallback to PyTorch for {', '.join(sorted(failed))}: "
                                 f"{_first(failed)}")
    return logging.INFO, line


def kernel_names() -> list[str]:
    """Every kernel of this directory (what an image builds ahead of time)."""
    return sorted(f[:-2] for f in os.listdir(_HERE) if f.endswith(".c"))


def _gemm_simd() -> str | None:
    """The instruction set the packed GEMM was compiled for, told by its panel width (two
    vectors): what decides its speed, so what a user wants to see at start-up."""
    lib = _loaded.get(("packed_linear", ()))
    if lib is None:
        return None
    lanes = lib.loom_linear_panel_width() // 2
    if lanes == 16:
        return "AVX-512"
    if lanes == 8:
        return "AVX2" if "avx2" in cpu_flags() else "AVX"
    return "NEON" if platform.machine() in ("aarch64", "arm64") else "SSE"


def _first(failed: dict[str, str]) -> str:
    return failed[sorted(failed)[0]]


def _failure_reason(exc: Exception) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        err = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"the C compiler failed: {err[-1] if err else exc}"
    return str(exc)


def _target_march() -> str:
    """LOOM_KERNEL_MARCH, unless this CPU lacks what that target needs: then native."""
    march = os.environ.get("LOOM_KERNEL_MARCH") or "native"
    if march not in _MARCH_FLAGS:  # native, or a target we cannot check: the user's call
        return march
    missing = _MARCH_FLAGS[march] - cpu_flags()
    if missing or platform.machine() not in ("x86_64", "AMD64"):
        _warn_once(f"march:{march}", "LOOM_KERNEL_MARCH=%s does not fit this CPU (lacks %s): "
                   "building the kernels for it instead (-march=native)", march,
                   " ".join(sorted(missing)) or "x86-64")
        return "native"
    return march


def _extra_cflags() -> list[str]:
    return shlex.split(os.environ.get("LOOM_KERNEL_CFLAGS", ""))


def _target_identity(march: str) -> bytes:
    if march != "native":  # built for a stated baseline: the same library fits every CPU
        return f"march={march}".encode()
    return _cpu_identity()


def _sources_digest() -> bytes:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(_HERE)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(_HERE, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.digest()


def _cpu_identity() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read().splitlines()
                     if ln.startswith((b"model name", b"flags"))]
        return b"\n".join(sorted(set(lines)))
    except OSError:
        return b""


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# -- where libraries live, and whether one may be trusted --------------------------------------


def _library_dir() -> str:
    """The shared cache directory, if it is safe to load code from (and to build into when
    it is writable); otherwise this process's private directory."""
    path = _cache_dir()
    try:
        _make_private_dirs(path)
    except OSError as exc:
        return _fall_back(path, f"cannot create it ({exc.strerror})")
    problem = _directory_problem(path)
    if problem is not None:
        return _fall_back(path, problem)
    return path


def _fall_back(path: str, problem: str) -> str:
    _warn_once(f"dir:{path}", "not loading native kernels from %s: %s; building them in a "
               "private directory instead", path, problem)
    return _private_build_dir()


def _make_private_dirs(path: str) -> None:
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


def _directory_problem(path: str) -> str | None:
    """Why code in `path` could have been written by someone else, or None. The directory
    itself must not be writable by group or others; its ancestors must not let them rename it
    (writable without the sticky bit, as /tmp has); all owned by us or root."""
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


def _file_problem(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & _OTHERS_WRITE:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class _Untrusted(Exception):
    """A library someone else could have written; the message says why."""


def _open_trusted(path: str) -> int | None:
    """A descriptor of the library at `path`, checked through that descriptor; None when
    there is no file there; _Untrusted when someone else could have written it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Untrusted("a symbolic link") from None
        raise
    problem = _file_problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise _Untrusted(problem)
    return fd


def _load_from(fd: int, path: str) -> ctypes.CDLL:
    """dlopen the file `fd` was opened on: not `path` again, which could name another file by
    now. The descriptor stays open for the process's life: the dynamic loader knows a library
    by the name it was opened under, and would hand the one loaded as /proc/self/fd/N to a
    later dlopen of that name, once N named another file."""
    proc_path = f"/proc/self/fd/{fd}"
    if not os.path.exists(proc_path):  # (not Linux: by path, checked just before)
        os.close(fd)
        return ctypes.CDLL(path)
    try:
        lib = ctypes.CDLL(proc_path)
    except OSError:
        os.close(fd)
        raise
    _library_fds.append(fd)
    lib._name = path  # (its repr and the tests name the library, not a descriptor)
    return lib


def _private_build_dir() -> str:
    """A directory of this process only (mkdtemp: 0700), removed at exit."""
    if not _private_dir:
        path = tempfile.mkdtemp(prefix="loom-kernels-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _private_dir.append(path)
    return _private_dir[0]


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _progress(what: str):
    # (This module runs without Loom's dependencies too, where an image prebuilds the kernels
    # with `python -S -m worker.kernels`: pipelines/ needs msgspec.)
    try:
        from pipelines.progress import Progress
    except ImportError:
        return contextlib.nullcontext()
    return Progress(what)


def _compile(source: str, target: str, defines: tuple[str, ...] = (),
             march: str = "native") -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (install gcc, or set CC)")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        # -ffast-math lets the dot products vectorise (reassociated sums); -march=native uses
        # the machine's SIMD width (or LOOM_KERNEL_MARCH's, for a library built to ship).
        try:
            subprocess.run([compiler, "-O3", f"-march={march}", "-ffast-math", "-fopenmp",
                            "-shared", "-fPIC", *(f"-D{d}" for d in defines), *_extra_cflags(),
                            source, "-o", tmp, "-lm"], check=True, capture_output=True)
        except FileNotFoundError as exc:  # CC names a compiler that is not there
            raise OSError(f"cannot run the C compiler {compiler}: {exc.strerror}") from None
        # The linker creates its output with the umask's mode: a group-writable umask would
        # make the library one the next start refuses.
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
