"""Process memory readings for the CPU benchmarks (Linux `/proc`)."""

from __future__ import annotations


def status_kb(field: str) -> int:
    """A `/proc/self/status` field in kB (`VmRSS`: resident now, `VmHWM`: high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark (`VmHWM`) to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mb() -> float:
    return status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    return status_kb("VmHWM") / 1024
