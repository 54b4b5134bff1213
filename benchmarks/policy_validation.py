"""Every cache policy's share of Belady's hits on the routing of trained models, budget by budget.

    python benchmarks/policy_validation.py benchmarks/traces/*.npz
    python benchmarks/policy_validation.py ../shared/models/tiny-code-moe validation-olmoe \\
        --save-traces benchmarks/traces

Each input is a trace file (`moestream trace`) or a trained Hugging Face checkpoint directory with a
heldout.txt beside its weights (benchmarks/train_moe.py writes one). A checkpoint is converted to a
temporary store (experts kept in the checkpoint's dtype) and the first --tokens tokens of its held-out text
are decoded one at a time through it (teacher forcing, `moestream trace`'s recording), so the trace is
what the runtime's cache sees on text the model never trained on. --save-traces keeps those traces (the
repository carries them in benchmarks/traces, so the comparison reruns without the checkpoints).

For each trace and each budget (shares of all its experts, default 5, 10, 20, 30%) it replays every
policy through the runtime's own cache and call order (moestream.tools.simulate; the hits are the ones the
runtime gets) and prints hits as a share of Belady's MIN, then one summary line per model: each policy's
mean share over the budgets, and whether the default is at or above LFU at every budget. --json FILE
writes it all; --record writes the table as the record of cache-policies (benchmarks/machine.py), under
the machine `any`: a replay gives the same hits on every machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import machine
import numpy as np

import moestream
from moestream.core.supply.policies import DEFAULT_POLICY, POLICIES
from moestream.tools.simulate import parse_budgets, shares_of_optimum, sweep
from moestream.tools.trace import Trace, record_text


def trace_of(source: Path, tokens: int, save_dir: Path | None) -> tuple[str, Trace]:
    if source.is_file():
        trace = Trace.load(source)
        return trace.meta.get("model", source.stem), trace
    text = (source / "heldout.txt").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        store = moestream.convert(source, Path(tmp) / "store", progress=False)
        trace = record_text(store, text, max_tokens=tokens)
    name = source.name
    # What a reader of the file needs, and no paths of the machine that made it.
    trace.meta.pop("store", None)
    trace.meta.update(model=name, text=f"{name}/heldout.txt, first {trace.tokens} tokens")
    training = source / "training.json"
    if training.exists():
        info = json.loads(training.read_text())
        trace.meta["trained"] = {k: info.get(k) for k in ("arch", "text", "steps_taken", "heldout_loss")}
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        path = trace.save(save_dir / f"{name}.npz")
        print(f"wrote {path}")
    return name, trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="trace files or trained checkpoint directories")
    parser.add_argument("--budgets", default="5,10,20,30", help="percent of all experts, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--tokens", type=int, default=1024, help="held-out tokens to decode per checkpoint")
    parser.add_argument("--save-traces", type=Path, default=None, metavar="DIR")
    parser.add_argument("--json", type=Path, default=None)
    machine.add_record_argument(parser, "cache-policies")
    args = parser.parse_args()
    shares_pct = [float(b) for b in args.budgets.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    report, summary = {}, []
    for source in args.inputs:
        name, trace = trace_of(source, args.tokens, args.save_traces)
        budgets = parse_budgets(",".join(f"{pct:g}%" for pct in shares_pct), trace)
        rows = sweep(trace, budgets, policies)
        shares = shares_of_optimum(rows)
        print(f"\n{name}: {trace.describe()}")
        print(f"{'budget':>7} {'belady':>7}  " + " ".join(f"{p:>8}" for p in policies))
        for i, (pct, row) in enumerate(zip(shares_pct, rows)):
            belady = row[-1].hit_rate
            print(f"{pct:>6g}% {belady:>7.1%}  " + " ".join(f"{shares[p][i]:>7.3f}x" for p in policies))
        means = {p: float(np.mean(shares[p])) for p in policies}
        print("   mean          " + " ".join(f"{means[p]:>7.3f}x" for p in policies))
        at_or_above = (
            all(d >= f for d, f in zip(shares.get(DEFAULT_POLICY, []), shares.get("lfu", []))) if "lfu" in shares else None
        )
        summary.append((name, means, at_or_above))
        report[name] = {
            "trace": trace.meta,
            "budgets_percent": shares_pct,
            "belady_hit_rate": [row[-1].hit_rate for row in rows],
            "share_of_optimum": shares,
            "mean_share_of_optimum": means,
        }
    print(f"\nmean share of Belady's hits over {args.budgets}% (default policy: {DEFAULT_POLICY})")
    print(f"{'model':<24} " + " ".join(f"{p:>8}" for p in policies) + "  default >= lfu at every budget")
    for name, means, ok in summary:
        print(f"{name:<24} " + " ".join(f"{means[p]:>7.3f}x" for p in policies) + f"  {ok}")
    if args.json:
        machine.write_json(args.json, {"default_policy": DEFAULT_POLICY, "models": report})
    if args.record:
        record(args, report, policies)


def record(args, report: dict, policies: list[str]) -> None:
    rows = []
    for name, r in report.items():
        shares = r["share_of_optimum"]
        for i, pct in enumerate(r["budgets_percent"]):
            rows.append(
                [
                    name if i == 0 else "",
                    f"{pct:g}%",
                    f"{r['belady_hit_rate'][i]:.1%}",
                    *(f"{shares[p][i]:.3f}x" for p in policies),
                ]
            )
        rows.append(["", "mean", "", *(f"{r['mean_share_of_optimum'][p]:.3f}x" for p in policies)])
    columns = ["model", "budget", "Belady's hit rate", *(f"{p} (default)" if p == DEFAULT_POLICY else p for p in policies)]
    caption = (
        "Each policy's hits as a share of Belady's MIN, replayed through the runtime's own cache and call order; "
        "budgets as shares of all experts:"
    )
    info = {**machine.describe(), "cpu": "any machine: a deterministic replay", "cores": None, "cpu_capability": "any"}
    table = machine.table(caption, columns, rows)
    path = machine.write_result(args.record, "Cache policies against Belady's optimum", machine.invocation(), [table], info=info)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
