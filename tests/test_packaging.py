"""`pip install .` ships what the fast path needs: the wheel carries the C kernel sources, and an
installed copy (not the source tree) compiles and loads every kernel.

The wheel is built from a copy of the package files, so the shared source tree gets no build/
directory, and the installed copy runs with `python -S` (no site-packages, so not the editable
install either) from a directory outside both."""

import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import ROOT

PACKAGES = ("api_server", "scheduler", "worker", "serialization", "processes", "pipelines",
            "bench")
KERNEL_SOURCES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "worker",
                                                                            "kernels", "*.[ch]")))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, a --target directory the wheel was installed into)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for package in PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), src / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
                          str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = glob.glob(str(tmp / "dist" / "*.whl"))
    target = tmp / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(target), wheel],
                   check=True, capture_output=True, timeout=120)
    return wheel, target


def test_wheel_ships_the_kernel_sources(installed):
    wheel, _ = installed
    assert KERNEL_SOURCES  # (the glob found the tree's kernels)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [s for s in KERNEL_SOURCES if f"worker/kernels/{s}" not in names]
    assert not missing, f"the wheel lacks {missing}"


def test_wheel_ships_the_web_chat_and_loom_bench(installed):
    """The web chat's page and assets (no CDN: it must work offline) and `loom bench`."""
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    static = sorted(os.listdir(os.path.join(ROOT, "api_server", "static")))
    assert {"index.html", "chat.js", "markdown.js", "chat.css"} <= set(static)
    missing = [n for n in static if f"api_server/static/{n}" not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert {"bench/cli.py", "bench/plot.py", "bench/load.py"} <= names
    # Nothing loaded from elsewhere: no absolute or protocol-relative asset URL.
    for name in static:
        with open(os.path.join(ROOT, "api_server", "static", name)) as f:
            text = f.read()
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?(https?:)?//|@import""",
                             text), name


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                    reason="no C compiler")
def test_installed_copy_builds_and_loads_every_kernel(installed, tmp_path):
    _, target = installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOOM_DISABLE_KERNELS", "LOOM_KERNEL_MARCH", "PYTHONPATH")}
    # At -O1: what this checks is that the installed files build and load, not how fast the
    # kernels run (every other test runs the default -O3 build); -O3 takes 2.5x as long.
    env.update(PYTHONPATH=str(target), LOOM_CACHE_DIR=str(tmp_path / "cache"),
               LOOM_KERNEL_CFLAGS="-O1")
    # Two compilers at a time (quant_linear.c, and decoder.c which includes it, take most of
    # the time); main() then finds every kernel loaded and reports as `python -m worker.kernels`.
    script = ("import concurrent.futures as f, worker.kernels as k, worker.kernels.__main__ as m; "
              "print(k.__file__); "
              "list(f.ThreadPoolExecutor(2).map(k.load_kernel, k.kernel_names())); "
              "raise SystemExit(m.main())")
    # (Minutes on a loaded small machine.)
    r = subprocess.run([sys.executable, "-S", "-c", script], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    module_file, summary = r.stdout.strip().splitlines()
    assert os.path.realpath(module_file).startswith(os.path.realpath(target) + os.sep)
    assert summary.startswith("native kernels: packed GEMM") and " -O1, in " in summary, summary
    assert f"{len(KERNEL_SOURCES)} built" in summary, summary
    built = os.listdir(tmp_path / "cache" / "kernels")
    assert sorted(name.split("-")[0] for name in built) == \
        sorted(s[:-2] for s in KERNEL_SOURCES if s.endswith(".c"))
