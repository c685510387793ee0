"""The host's free memory, read without PyTorch (the API process sizes model loads with it,
the worker its KV cache)."""

GiB = 1 << 30


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB
