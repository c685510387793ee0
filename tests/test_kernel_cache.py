"""The kernel cache runs only code this user (or root) wrote: its directories are created 0700,
and a library someone else could have written is refused, never loaded.

Each case runs in a fresh process (the loader keeps what it loaded) on the smallest kernel. A
planted library is real code whose constructor leaves a marker file, so "not loaded" means its
code did not run, and a control case shows the same library does run once it is trustworthy."""

import os
import platform
import shutil
import stat
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no C compiler")

KERNEL = "layer_ops"
LOAD = ("import sys, worker.kernels as k; lib = k.load_kernel(sys.argv[1]); "
        "print(lib._name if lib else None); print(k.startup_summary()[1])")
# The same, but the library's path is given another file (`SWAP_IN`) once the loader has
# checked it, just before it loads it: the race a check by path would lose.
SWAP = ("import ctypes, os, sys, worker.kernels as k\n"
        "real = ctypes.CDLL\n"
        "def swapped(name, *args, **kwargs):\n"
        "    os.replace(os.environ['SWAP_IN'], os.environ['SWAP_AT'])\n"
        "    return real(name, *args, **kwargs)\n"
        "ctypes.CDLL = swapped\n"
        "lib = k.load_kernel(sys.argv[1]); lib.loom_rms_norm\n"
        "print(lib._name); print(k.startup_summary()[1])\n")


def load(cache, script=LOAD, **env):
    """(path of the library loaded or None, start-up summary line, stderr) in a fresh process."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LOOM_DISABLE_KERNELS", "LOOM_KERNEL_MARCH", "LOOM_KERNEL_CFLAGS",
                          "LOOM_CACHE_DIR")}
    r = subprocess.run([sys.executable, "-c", script, KERNEL], cwd=ROOT, capture_output=True,
                       text=True, timeout=60,
                       env=dict(clean, PYTHONPATH=ROOT, LOOM_CACHE_DIR=str(cache), **env))
    assert r.returncode == 0, r.stderr
    path, summary = r.stdout.strip().splitlines()
    return (None if path == "None" else path), summary, r.stderr


def plant(path, marker):
    """Compile, at `path`, a library whose load creates `marker`."""
    source = path.parent / "planted.c"
    source.write_text('#include <fcntl.h>\n#include <unistd.h>\n'
                      '__attribute__((constructor)) static void planted(void) '
                      f'{{ close(open("{marker}", O_CREAT | O_WRONLY, 0600)); }}\n')
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()


@pytest.fixture
def cached(tmp_path):
    """(cache root, the path of the kernel's library in it) after a first, ordinary build."""
    cache = tmp_path / "cache"
    path, _, _ = load(cache)
    assert path and path.startswith(str(cache / "kernels") + os.sep)
    return cache, path


def test_cache_directories_are_created_private(tmp_path):
    cache = tmp_path / "new" / "loom"
    path, summary, _ = load(cache)
    assert os.path.dirname(path) == str(cache / "kernels")
    for directory in (tmp_path / "new", cache, cache / "kernels"):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, directory
    assert not os.stat(path).st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert summary.startswith("native kernels:") and "1 built" in summary


def test_world_writable_library_is_not_loaded(cached, tmp_path):
    cache, path = cached
    marker = tmp_path / "planted-code-ran"
    os.unlink(path)
    plant(tmp_path / "planted.so", marker)
    shutil.move(tmp_path / "planted.so", path)
    os.chmod(path, 0o666)
    loaded, _, err = load(cache)
    assert not marker.exists()
    assert "refusing cached native kernel" in err and "writable by group or others" in err
    assert loaded and loaded != path  # rebuilt privately, and it works
    # Control: the same file, no longer writable by others, is loaded (so the mode was what
    # kept it out, not a mistake in the planted library).
    os.chmod(path, 0o755)
    assert load(cache)[0] == path and marker.exists()


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_directory_writable_by_group_or_others_is_not_trusted(cached, tmp_path, mode):
    cache, path = cached
    marker = tmp_path / "planted-code-ran"
    os.unlink(path)
    plant(tmp_path / "planted.so", marker)
    shutil.move(tmp_path / "planted.so", path)
    os.chmod(path, 0o755)
    os.chmod(cache / "kernels", mode)
    loaded, _, err = load(cache)
    assert not marker.exists()
    assert f"writable by group or others (mode {mode:o})" in err
    assert loaded and not loaded.startswith(str(cache))


def test_symbolic_link_is_not_followed(cached, tmp_path):
    cache, path = cached
    marker = tmp_path / "planted-code-ran"
    plant(tmp_path / "planted.so", marker)
    os.unlink(path)
    os.symlink(tmp_path / "planted.so", path)
    loaded, _, err = load(cache)
    assert not marker.exists()
    assert "refusing cached native kernel" in err and "a symbolic link" in err
    assert loaded and loaded != path


def test_library_swapped_after_its_check_is_not_the_one_loaded(cached, tmp_path):
    """The loader checks the file it opened and loads that open file: a library put at the
    path between the check and dlopen never runs."""
    cache, path = cached
    marker = tmp_path / "planted-code-ran"
    plant(tmp_path / "planted.so", marker)
    os.chmod(tmp_path / "planted.so", 0o755)
    loaded, summary, _ = load(cache, SWAP, SWAP_IN=str(tmp_path / "planted.so"), SWAP_AT=path)
    assert loaded == path and "1 loaded from cache" in summary
    assert not marker.exists()
    # Control: the planted file, now at the path and trustworthy (ours, 0755), does run when
    # the path is loaded afresh.
    assert load(cache)[0] == path and marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_library_of_another_user_is_not_loaded(cached, tmp_path):
    cache, path = cached
    os.chown(path, 54321, 54321)
    loaded, _, err = load(cache)
    assert "owned by uid 54321" in err
    assert loaded and loaded != path


def test_libraries_loaded_one_after_another_are_each_their_own(tmp_path):
    """Each library is loaded from its own descriptor (/proc/self/fd/N): a later one must not
    be handed an earlier one that the dynamic loader knows under the same name."""
    script = ("import sys, worker.kernels as k\n"
              "norms = k.load_kernel('layer_ops'); gemm = k.load_kernel('packed_linear')\n"
              "print(gemm.loom_linear_panel_width() > 0, bool(norms.loom_rms_norm))\n"
              "print(k.startup_summary()[1])\n")
    assert load(tmp_path / "cache", script)[0] == "True True"


def test_cached_library_loads_without_a_compiler(cached):
    cache, path = cached
    loaded, summary, _ = load(cache, CC="/nonexistent/cc")
    assert loaded == path and "1 loaded from cache" in summary


def test_no_compiler_is_one_clear_fallback_line(tmp_path):
    loaded, summary, _ = load(tmp_path / "cache", CC="/nonexistent/cc")
    assert loaded is None
    assert summary == ("native kernels: fallback to PyTorch: cannot run the C compiler "
                       "/nonexistent/cc: No such file or directory")


def test_extra_compiler_flags_are_a_build_of_their_own(cached):
    """LOOM_KERNEL_CFLAGS reaches the compiler, after its own flags, and is part of the cache
    key: the default library is not reused for such a build, nor such a build for the default."""
    cache, default = cached
    loaded, summary, _ = load(cache, LOOM_KERNEL_CFLAGS="--no-such-flag")
    assert loaded is None and "fallback to PyTorch" in summary  # (gcc refused the flag)
    flagged, summary, _ = load(cache, LOOM_KERNEL_CFLAGS="-O1 -g")
    assert flagged and flagged != default
    assert "1 built" in summary and " -O1 -g, in " in summary, summary
    again, summary, _ = load(cache)
    assert again == default and "1 loaded from cache" in summary


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 baselines")
def test_baseline_build_is_found_by_any_cpu_of_that_baseline(tmp_path):
    """An image builds for LOOM_KERNEL_MARCH (keyed by it, not by the build machine's CPU) and
    the final stage, without a compiler, loads it."""
    cache = tmp_path / "cache"
    built, summary, _ = load(cache, LOOM_KERNEL_MARCH="x86-64")
    assert "-march=x86-64," in summary
    loaded, summary, _ = load(cache, LOOM_KERNEL_MARCH="x86-64", CC="/nonexistent/cc")
    assert loaded == built and "loaded from cache" in summary


def test_cold_start_logs_progress_every_few_seconds(tiny_model_dir, tmp_path, monkeypatch):
    """`loom serve` with kernels to build says so while it builds and loads: no silent gap
    between its first progress line and the ready line. (The cache is seeded with the other
    kernels this session built, so that only two compile here: a fully cold start takes
    minutes on a small machine, with the same lines.)"""
    from datetime import datetime

    import worker.kernels as kernels
    from tests.helpers import start_server

    built = kernels._cache_dir()
    cold = tmp_path / "cache" / "kernels"
    cold.mkdir(parents=True, mode=0o700)
    for name in os.listdir(built) if os.path.isdir(built) else ():
        if name.endswith(".so") and not name.startswith(("layer_ops-", "paged_prefill")):
            shutil.copy2(os.path.join(built, name), cold / name)
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LOOM_PROGRESS_INTERVAL", "0.5")
    srv = start_server(tiny_model_dir)
    # (What start-up leaves of the KV cache is faulted in once the worker is idle.)
    deadline = time.monotonic() + 30
    while "faulting in the KV cache: done" not in srv.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.stop() == 0
    log = srv.log().splitlines()
    assert any("compiling native kernel layer_ops" in line and "done in" in line for line in log)
    assert any(f"loading the weights of {tiny_model_dir}: done in" in line for line in log)
    assert any("faulting in the KV cache: done in" in line for line in log), log
    first = next(i for i, line in enumerate(log) if "loom.progress" in line)
    ready = next(i for i, line in enumerate(log) if line.startswith("loom: serving"))
    assert "web chat http://127.0.0.1:" in log[ready] and "/metrics" in log[ready]
    stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
              for line in log[first:ready] if line[:4].isdigit()]
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) >= 3 and max(gaps) < 3.0, log[first:ready + 1]
