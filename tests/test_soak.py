"""A short soak (benchmarks/soak.py) in the suite: three clients over every API for half a minute against a tiny
model with disk faults injected, a SIGTERM and a restart in the middle: nothing unexpected, the probes' answers
unchanged, both stops clean."""

import json
import subprocess
import sys
from pathlib import Path

from test_openai_features import checkpoint  # noqa: F401 (fixture: a tiny store whose template has tool calls)

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def test_a_short_soak_with_faults_and_a_restart_loses_nothing(checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "soak.json"
    command = [sys.executable, str(SOAK), str(checkpoint[1]), "--minutes", "0.5", "--clients", "3", "--context", "256"]
    command += ["--faults", "read_error:0.2,short_read:0.1,seed:5", "--serve-args", "--memory 16KiB --verify always"]
    command += ["--max-queue", "4", "--max-batch", "2", "--sample-every", "1", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["unexpected"] and result["probes equal"], result
    assert result["stop"]["exit code"] == 0 and result["final exit code"] == 0
    assert result["requests"] > 20 and any(key.endswith("429") for key in result["outcomes"]), result["outcomes"]
