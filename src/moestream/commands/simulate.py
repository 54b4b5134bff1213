"""`moestream simulate`: its options and what it runs (the work itself: moestream.tools.simulate)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..choices import DEFAULT_POLICY, POLICIES
from ..errors import UsageError
from ..options import existing_file, positive

DESCRIPTION = (
    "Replay a routing trace through the runtime's own cache and policies (no model, no disk): hit "
    "rate, fraction of the optimum and expert bytes read per token for each budget and policy, next to "
    "Belady's MIN (evict the expert needed farthest in the future), the upper bound no policy can pass. The "
    "simulator makes the runtime's cache operations in the runtime's order, so its hit counts are the ones "
    "`generate --policy P --memory M` gets on the same routing from demand reads (speculative prefetch reads "
    "are not in a trace)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    policies = ",".join(POLICIES)
    parser.add_argument("trace", help="a trace file from `moestream trace` or `generate --trace-out`")
    parser.add_argument(
        "--memory",
        default="5%,10%,20%,30%,50%",
        help="comma-separated expert cache budgets: sizes (1GiB,2GiB) or shares of all experts (10%%); default "
        "5%%,10%%,20%%,30%%,50%%",
    )
    parser.add_argument("--policy", default=policies, help=f"comma-separated policies to compare (default {policies})")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="also write PNGs to DIR: hit rate against budget per policy with the optimum (on these budgets and a "
        "grid from the minimum to all experts), expert popularity per layer, reuse distance histogram (needs matplotlib)",
    )


def run(args: argparse.Namespace) -> int:
    from ..tools.simulate import parse_budgets, plot_grid, shares_of_optimum, sweep, table
    from ..tools.trace import Trace

    if args.plot and Path(args.plot).exists() and not Path(args.plot).is_dir():
        raise UsageError(f"--plot {args.plot} is a file; pass a directory to write the PNGs into")
    trace = Trace.load(existing_file(args.trace, "trace", "trace file (.npz) from `moestream trace`"))
    budgets, policies = parse_budgets(args.memory, trace), [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        raise UsageError(f"--policy names no policy; pass some of {','.join(POLICIES)}")
    for budget in budgets:
        positive(budget, "--memory")
    rows = sweep(trace, budgets, policies)
    if args.json:
        shares = shares_of_optimum(rows)
        print(
            json.dumps(
                {
                    "trace": trace.meta,
                    "results": [[r.to_json() for r in row] for row in rows],
                    "share_of_optimum": shares,  # per policy, per budget: hits / Belady's hits
                    "mean_share_of_optimum": {name: sum(v) / len(v) for name, v in shares.items()},
                    "default_policy": DEFAULT_POLICY,
                }
            )
        )
    else:
        print(table(trace, rows))
    if args.plot:
        from ..tools.plots import plot_all

        for path in plot_all(trace, sweep(trace, plot_grid(trace, budgets), policies), args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0
