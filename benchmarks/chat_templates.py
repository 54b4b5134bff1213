"""Tool calls through the real chat templates of the MoE families: the result of tests/test_chat_templates.py
per template, as a table.

    python benchmarks/chat_templates.py [--record]

Runs the test module (pytest, with a JUnit report) and prints, for each template in tests/data/chat_templates,
the format moestream reads in it and whether each check held: an assistant turn of two calls rendered by the
template reads back as those calls; the same, streamed in two pieces split at every position; a tiny model's
forced call (tool_choice required, enum arguments) through the template's prompt and grammar comes back as a
call of the tool, with the template's thinking on and off where it has the switch. `--record` writes the table
as this machine's record of chat-templates (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import machine

ROOT = Path(__file__).resolve().parent.parent
CHECKS = {
    "test_a_rendered_turn_of_calls_reads_back_as_its_calls": "turn of calls read back",
    "test_a_rendered_turn_streamed_split_anywhere_reads_back_the_same": "streamed, split anywhere",
    "test_a_forced_call_is_generated_through_the_template": "forced call (thinking on and off where switchable)",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    machine.add_record_argument(parser, "chat-templates")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_chat_templates import EXPECTED  # the templates and the format each is read in

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [sys.executable, "-m", "pytest", "tests/test_chat_templates.py", "-q", "-p", "no:cacheprovider"]
        done = subprocess.run([*command, f"--junitxml={report}"], cwd=ROOT)
        cases = ET.parse(report).getroot().iter("testcase")
        outcome: dict[tuple[str, str], str] = {}
        for case in cases:
            match = re.fullmatch(r"(\w+)\[(.+)\]", case.get("name", ""))
            if match and match.group(1) in CHECKS:
                failed = case.find("failure") is not None or case.find("error") is not None
                outcome[(match.group(2), match.group(1))] = "fails" if failed else "holds"
    rows = [
        [name, family, *(outcome.get((name, test), "not run") for test in CHECKS)] for name, family in sorted(EXPECTED.items())
    ]
    columns = ["template", "format", *CHECKS.values()]
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    for row in [columns, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    held = sum(all(c == "holds" for c in row[2:]) for row in rows)
    print(f"\n{held} of {len(rows)} templates hold every check (pytest exit code {done.returncode})")
    if args.record:
        caption = (
            f"The chat templates of {len(rows)} MoE families from llama.cpp's source tree (tests/data/chat_templates), "
            "through tests/test_chat_templates.py:"
        )
        table = machine.table(caption, columns, rows)
        notes = (
            f"{held} of {len(rows)} hold every check. The forced call is generated in-process by the serving "
            "scheduler (moestream.generate_batch) on a tiny random Qwen3-MoE, from the chat completions endpoint's "
            "own parse of the request (prompt and grammar), so everything but the HTTP framing is the server's path; "
            "its reasoning is ended at once by a logit bias on the block's closing token, which the grammar allows "
            "only while the block is open."
        )
        path = machine.write_result(
            args.record, "Tool calls through the MoE families' chat templates", machine.invocation(), [table], notes
        )
        print(f"wrote {path}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
