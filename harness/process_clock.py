"""How long this process has existed, from ``/proc`` (so the interpreter's own start-up and its
imports count): what the GPU tier's timeline and the bisect's engine start-up figures are
measured with. Linux only; elsewhere ``None``."""

from __future__ import annotations

import os
import pathlib
import time


def process_age_s() -> float | None:
    """Seconds since this process started (``/proc/self/stat``'s starttime against ``/proc/uptime``,
    both on the boot clock, to a clock tick); None where ``/proc`` does not say."""
    try:
        fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot
        uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def process_start_epoch() -> float | None:
    """This process's start in seconds since the epoch (``process_age_s`` before now); None off Linux."""
    age = process_age_s()
    return None if age is None else time.time() - age
