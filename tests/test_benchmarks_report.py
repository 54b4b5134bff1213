"""docs/BENCHMARKS.md is generated from benchmarks/results by benchmarks/report.py: it must be what the
records make, and no figure may be published without its machine, commit and command."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    # benchmarks/ is a folder of scripts, not a package: load the file itself.
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("report")
machine = report.machine

INFO = {"cpu": "AMD EPYC 7B13 64-Core Processor", "cores": 2, "cpu_capability": "AVX2", "torch": "2.13.0+cpu", "gpu": None}


def test_document_is_current():
    assert report.check() == [], "docs/BENCHMARKS.md is out of date: run `python benchmarks/report.py`"


def test_every_record_names_machine_commit_and_command():
    records = report.load(machine.RESULTS)
    assert records
    for path, record in records:
        assert record["machine"]["cpu"], path
        assert record["machine"]["commit"], path
        assert record["command"].strip(), path
        assert record["capability"] in report.ORDER, path


def test_a_record_without_its_command_is_refused(tmp_path):
    table = machine.table("caption", ["a"], [[1]])
    with pytest.raises(ValueError, match="no command"):
        machine.write_result("squeeze", "T", "", [table], info={**INFO, "commit": "abc"}, results=tmp_path)
    assert not list(tmp_path.rglob("*.json"))
    # Nor is one written by hand: --check names it.
    record = {"capability": "squeeze", "title": "T", "machine": {**INFO, "commit": "abc"}, "date": "2026-01-01"}
    (tmp_path / "squeeze").mkdir()
    (tmp_path / "squeeze" / "amd-epyc-avx2.json").write_text(json.dumps({**record, "tables": [], "notes": ""}))
    found = report.check(tmp_path, tmp_path / "BENCHMARKS.md")
    assert any("no command" in line for line in found)


def test_runs_at_one_commit_add_to_the_record_and_a_new_commit_replaces_it(tmp_path):
    info = {**INFO, "commit": "abc"}
    path = machine.write_result("squeeze", "T", "run 1", [machine.table("bf16", ["a"], [[1]])], info=info, results=tmp_path)
    assert path == tmp_path / "squeeze" / "amd-epyc-avx2.json"
    machine.write_result("squeeze", "T", "run 2", [machine.table("fp32", ["a"], [[2]])], info=info, results=tmp_path)
    record = json.loads(path.read_text())
    assert [t["caption"] for t in record["tables"]] == ["bf16", "fp32"]
    assert record["command"] == "run 1\nrun 2"
    machine.write_result(
        "squeeze", "T", "run 3", [machine.table("bf16", ["a"], [[3]])], info={**info, "commit": "def"}, results=tmp_path
    )
    record = json.loads(path.read_text())
    assert [t["rows"] for t in record["tables"]] == [[["3"]]]
    assert record["command"] == "run 3"
    assert report.check(tmp_path, tmp_path / "BENCHMARKS.md") == [
        "BENCHMARKS.md is not what the records make: run `python benchmarks/report.py`"
    ]


def test_machine_slugs():
    assert machine.machine_slug({**INFO}) == "amd-epyc-avx2"
    xeon = {"cpu": "Intel(R) Xeon(R) Platinum 8488C", "cpu_capability": "AVX512", "gpu": "NVIDIA H200"}
    assert machine.machine_slug(xeon) == "intel-xeon-avx512-nvidia-h200"
