"""Where a benchmark ran, for its JSON and its first printed line: the CPU, torch's view of it, torch's
version and the commit of the moestream imported; and the result records docs/BENCHMARKS.md is made from.

    import machine                       # the benchmarks run as `python benchmarks/NAME.py`
    print(machine.line())
    machine.write_json(path, results)    # {"machine": describe(), **results}
    machine.write_result("long-context", "Long context against llama.cpp", machine.invocation(), tables)

A result record is one capability measured on one kind of machine, in
`benchmarks/results/<capability>/<machine slug>.json`; a newer run of the same capability on the same kind
of machine replaces the file (git keeps the old one). Runs at the same commit add to it instead: a table
whose caption is new is added, one whose caption it already has is replaced, and the command gains the
run's line, so that a capability measured by several commands (two dtypes, a script and `moestream eval`)
stays one record of one commit. `python benchmarks/report.py` makes docs/BENCHMARKS.md from every record.
Its fields:

    {"capability": "long-context",                  # the slug: the folder's name and the document's anchor
     "title": "Long context against llama.cpp",
     "machine": {"cpu", "cores", "cpu_capability", "torch", "gpu", "commit"},   # describe()
     "date": "YYYY-MM-DD",
     "command": "the exact command(s), one a line",
     "tables": [{"caption": "...", "columns": ["...", ...], "rows": [["...", ...], ...]}],
     "notes": "short markdown: what the figures mean, caveats"}

The machine's slug (`machine_slug`) is its CPU's vendor and family, torch's CPU capability and the GPU,
if any (`intel-xeon-avx512`, `amd-epyc-avx2`): the same on every run on that kind of machine, so a rerun
replaces its own record and never another machine's.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
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


def compiled_kernels():
    """The compiled kernels' module for a kernel benchmark, or exit naming why they are off."""
    from moestream.native import fused_build

    ext = fused_build.extension()
    if ext is None:
        raise SystemExit(f"the compiled kernels are off: {fused_build.unavailable_reason()}")
    return ext


def write_json(path: str | os.PathLike, results: dict) -> None:
    Path(path).write_text(json.dumps({"machine": describe(), **results}, indent=1) + "\n")


RESULTS = Path(__file__).resolve().parent / "results"
RECORD_KEYS = ("capability", "title", "machine", "date", "command", "tables", "notes")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def machine_slug(m: dict) -> str:
    """The kind of machine, not the machine: a CPU model's number and the core count stay out of it, so
    that two runs on two hosts of the same family land in one record."""
    cpu = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b", " ", m["cpu"].lower())
    if cpu.startswith("any"):
        return "any"  # arithmetic or a deterministic replay: the same figures on every machine
    words = re.findall(r"[a-z0-9]+", cpu)
    if cpu.startswith("not recorded"):
        family = "unrecorded"
    elif words and words[0] in ("intel", "amd"):
        family = " ".join(words[:2])
    else:
        family = words[0] if words else "cpu"
    return slug(" ".join([family, m["cpu_capability"] or "", m.get("gpu") or ""]))


def problems(record: dict) -> list[str]:
    """What keeps a record out of docs/BENCHMARKS.md: a figure without its machine, commit or command
    cannot be rerun or compared, so it is not published."""
    found = [f"no {key}" for key in RECORD_KEYS if key not in record]
    m = record.get("machine") or {}
    if not isinstance(m, dict) or not m.get("cpu"):
        found.append("no machine")
    elif not m.get("commit"):
        found.append("no commit")
    if not str(record.get("command") or "").strip():
        found.append("no command")
    if record.get("capability") and record["capability"] != slug(record["capability"]):
        found.append(f"capability {record['capability']!r} is not a slug")
    for table in record.get("tables") or []:
        width = len(table.get("columns") or [])
        if not width or any(len(row) != width for row in table.get("rows") or []):
            found.append(f"table {table.get('caption', '')!r}: rows and columns differ in width")
    return found


# Settings that change what a benchmark measures, so a record's command names them when they are set.
COMMAND_ENV = ("ATEN_CPU_CAPABILITY", "MOESTREAM_LOWBIT_ISA", "MOESTREAM_FUSED", "OMP_NUM_THREADS")


def invocation() -> str:
    """This process's command as a benchmark is run: `python benchmarks/NAME.py ARGS`, after the settings
    of COMMAND_ENV that are set. Paths are written as given: relative ones keep a record free of this
    machine's layout."""
    env = [f"{name}={os.environ[name]}" for name in COMMAND_ENV if name in os.environ]
    return " ".join([*env, shlex.join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])])


def add_record_argument(parser, capability: str) -> None:
    """`--record [CAPABILITY]`: the run's tables as this machine's record (machine.write_result)."""
    parser.add_argument(
        "--record",
        nargs="?",
        const=capability,
        metavar="CAPABILITY",
        help=f"write the results as this machine's record of CAPABILITY (default {capability}) in "
        "benchmarks/results; then `python benchmarks/report.py` remakes docs/BENCHMARKS.md",
    )


def write_result(
    capability: str,
    title: str,
    command: str | list[str],
    tables: list[dict],
    notes: str = "",
    info: dict | None = None,
    results: str | os.PathLike = RESULTS,
) -> Path:
    """Write (or replace) this machine's record of `capability`; returns its path."""
    record = {
        "capability": capability,
        "title": title,
        "machine": info or describe(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": command if isinstance(command, str) else "\n".join(command),
        "tables": tables,
        "notes": notes,
    }
    found = problems(record)
    if found:
        raise ValueError(f"result record {capability!r} refused: {', '.join(found)}")
    path = Path(results) / capability / f"{machine_slug(record['machine'])}.json"
    if path.exists():
        record = _merged(json.loads(path.read_text()), record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path


def _merged(old: dict, new: dict) -> dict:
    """`new` over the record already there: its title stays (it is the document's heading); at the same
    commit its tables and command lines stay too, but for the tables this run measured again."""
    new = {**new, "title": old.get("title") or new["title"]}
    if (old.get("machine") or {}).get("commit") != new["machine"]["commit"]:
        return new
    fresh = {t["caption"]: t for t in new["tables"]}
    tables = [fresh.pop(t["caption"], t) for t in old.get("tables", [])] + list(fresh.values())
    lines = old.get("command", "").splitlines()
    command = "\n".join(lines + [line for line in new["command"].splitlines() if line not in lines])
    paragraphs = [p for p in old.get("notes", "").split("\n\n") if p.strip()]
    notes = "\n\n".join(paragraphs + [p for p in new["notes"].split("\n\n") if p.strip() and p not in paragraphs])
    return {**new, "tables": tables, "command": command, "notes": notes}


def table(caption: str, columns: list[str], rows: list[list]) -> dict:
    """One table of a record; cells are written as they will be shown."""
    return {"caption": caption, "columns": list(columns), "rows": [[_cell(c) for c in row] for row in rows]}


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)
