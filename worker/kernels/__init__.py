"""Small native kernels, built on first use with the system C compiler and loaded with ctypes.

No torch headers, so a build takes about a second; the library is cached by source hash and CPU.
Without a compiler, callers fall back to the portable PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_loaded: dict[tuple[str, tuple[str, ...]], ctypes.CDLL | None] = {}


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
        return None
    source = os.path.join(_HERE, f"{name}.c")
    # Every source of the directory is part of the key (a kernel may #include another), and
    # so is the CPU: -march=native code built on another one (a shared home directory) could
    # use instructions this one lacks.
    digest = hashlib.sha256(_sources_digest() + _cpu_identity() + repr(defines).encode())
    digest = digest.hexdigest()
    target = os.path.join(_cache_dir(), f"{name}-{digest[:16]}.so")
    try:
        if not os.path.exists(target):
            _compile(source, target, defines)
        _loaded[key] = ctypes.CDLL(target)
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("native kernel %s unavailable (%s); using the PyTorch path", name, exc)
        _loaded[key] = None
    return _loaded[key]


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


def _compile(source: str, target: str, defines: tuple[str, ...] = ()) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        # -ffast-math lets the dot products vectorise (reassociated sums); -march=native uses
        # the machine's SIMD width. The library is cached per machine, never shipped.
        subprocess.run([compiler, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared",
                        "-fPIC", *(f"-D{d}" for d in defines), source, "-o", tmp, "-lm"],
                       check=True, capture_output=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
