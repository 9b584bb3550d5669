"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

import psutil
import torch

__all__ = ["machine_info"]


def machine_info() -> dict[str, Any]:
    """Platform, cores, memory, library versions and the load average at the time.

    The machines these run on may be shared: a high load average explains noisy
    times and slow or timed-out swarms, so it travels with every result.
    """
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1_5_15m": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "hivemind": importlib.metadata.version("hivemind"),
    }
