"""`python -m worker.kernels`: build (or find in the cache) every native kernel, print the
start-up line the worker would log, exit 1 if any is missing.

An image runs this in its build stage (with `LOOM_CACHE_DIR` and `LOOM_KERNEL_MARCH` set) so the
final stage ships the libraries and no compiler.
"""

from __future__ import annotations

import sys

from worker.kernels import kernel_names, load_kernel, startup_summary


def main() -> int:
    missing = [name for name in kernel_names() if load_kernel(name) is None]
    print(startup_summary()[1])
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
