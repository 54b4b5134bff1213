"""Where a benchmark ran, for its JSON and its first printed line: the CPU, torch's view of it, torch's
version and the commit of the moestream imported. docs/BENCHMARKS.md names these beside every figure.

    import machine                       # the benchmarks run as `python benchmarks/NAME.py`
    print(machine.line())
    machine.write_json(path, results)    # {"machine": describe(), **results}
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    """The commit of the moestream imported, with "+changes" when its sources differ from it."""
    import moestream

    src = Path(moestream.__file__).resolve().parent

    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(src), *argv], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return f"moestream {moestream.__version__} (not a git checkout)"
    return head + ("+changes" if git("status", "--short", "--", ".") else "")


def describe() -> dict:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "commit": commit(),
    }


def line(info: dict | None = None) -> str:
    m = info or describe()
    gpu = f", {m['gpu']}" if m["gpu"] else ""
    return f"{m['cpu']} ({m['cores']} cores, {m['cpu_capability']}{gpu}), torch {m['torch']}, moestream {m['commit']}"


def write_json(path: str | os.PathLike, results: dict) -> None:
    Path(path).write_text(json.dumps({"machine": describe(), **results}, indent=1) + "\n")
