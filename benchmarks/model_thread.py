"""One bf16 matmul of one row (a decode step's shape) timed on the thread that ran torch's kernels first and
on a second thread, in fresh processes: why `serve` loads its model on the thread that then steps it
(generation/worker.py, `ModelThread`; docs/DECISIONS.md, "The server's model thread").

    python benchmarks/model_thread.py [--calls 2000] [--record]

torch's CPU kernels run on OpenMP, which keeps a thread pool per thread that starts a parallel region.
Three processes, each with torch's threads set to this machine's cores:
- `main thread`: the matmul on the main thread;
- `second thread, main ran kernels first`: the main thread runs the matmul (its pool starts), then a second
  thread times it, as a server stepping a model that its main thread loaded;
- `second thread alone`: only a second thread ever runs kernels.
"""

import argparse
import json
import subprocess
import sys
import threading
import time

import machine

SHAPE = (1536, 1024)  # N x K: a 30B-shape expert's first matrix is 1536 x 2048; the fixture's, 1536 x 1024
MODES = ("main thread", "second thread, main ran kernels first", "second thread alone")


def _time(calls: int) -> float:
    import torch

    x = torch.randn(1, SHAPE[1], dtype=torch.bfloat16)
    w = torch.randn(*SHAPE, dtype=torch.bfloat16)
    for _ in range(50):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) / calls * 1e6


def child(mode: str, calls: int) -> float:
    import torch

    torch.set_num_threads(machine.describe()["cores"])
    if mode == MODES[0]:
        return _time(calls)
    if mode == MODES[1]:
        _time(100)  # the main thread's pool starts
    out = []
    thread = threading.Thread(target=lambda: out.append(_time(calls)))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    machine.add_record_argument(parser, "model-thread")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.calls)))
        return
    print(f"machine: {machine.line()}")
    times = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            done = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--calls", str(args.calls)],
                capture_output=True,
                text=True,
                check=True,
            )
            times[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for mode in MODES:
        print(f"  {mode:<40} {' '.join(f'{t:7.1f}' for t in times[mode])} us per call")
        rows.append([mode, " ".join(f"{t:.1f}" for t in times[mode]), f"{min(times[mode]):.1f}"])
    if args.record:
        caption = (
            f"One row through a {SHAPE[0]}x{SHAPE[1]} bf16 matrix (`F.linear`), {args.calls} calls after 50 untimed, "
            f"torch's threads at the machine's cores, a fresh process per run, {args.rounds} rounds:"
        )
        table = machine.table(caption, ["where the calls run", "us per call, each round", "best"], rows)
        title = "Kernels on a second thread (the server's model thread)"
        print(f"wrote {machine.write_result(args.record, title, machine.invocation(), [table])}")


if __name__ == "__main__":
    main()
