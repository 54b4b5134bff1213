"""Decode and prefill at long context, moestream against llama.cpp on the same model, in one command.

    python benchmarks/long_context.py STORE GGUF [--contexts 8192 16384 32768] [--steps 16] [--threads 2]

Each engine runs in a fresh process, one after another (moestream, llama.cpp, moestream with an 8-bit KV
cache, llama.cpp with q8_0 keys and values), and feeds the same token ids: a prompt of the first context's
length in one prefill (timed: the prefill figure), then `--steps` single-token decode steps (timed), then
the next stretch of ids as one more prefill up to the next context, `--steps` decode steps there, and so
on. Decode steps are teacher-forced from the same ids (a step costs the same whatever its token is, and
both engines then hold the same sequence). Every expert is in memory before anything is timed: moestream
prefills a 512-token warm-up prompt first (it routes to every expert) with a budget that holds them all,
llama.cpp evaluates the same warm-up (faulting its mmap'd file in). llama.cpp runs with flash attention
(its long-context setting, and what its quantized V cache needs) and a prefill batch of 512; the engine
`llama.cpp-nofa` runs it without (llama-cpp-python's default).

Needs llama-cpp-python (a benchmark tool, not a dependency). Prints a table per context and the ratios;
`--json FILE` writes them with the machine's record.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 512
SEED = 1234


def token_ids(n: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(SEED)).tolist()


def plan(contexts: list[int], steps: int) -> list[tuple[int, int]]:
    """(start, end) of each prefill stretch: the first from 0, each next one after the previous decode steps."""
    stretches, fed = [], 0
    for context in contexts:
        stretches.append((fed, context))
        fed = context + steps
    return stretches


def run_moestream(store: str, memory: str, contexts: list[int], steps: int, threads: int, kv: str) -> dict:
    import torch

    import moestream
    from moestream.frontends.generate import Forward
    from moestream.frontends.kv_layer import grow_in_place

    torch.set_num_threads(threads)
    model, _ = moestream.load(store, memory, kv_cache_dtype=kv, prefetch="off")
    vocab = model.config.vocab_size
    ids = token_ids(contexts[-1] + steps, vocab)
    with torch.inference_mode():
        Forward(model)(torch.tensor([token_ids(WARMUP + 7, vocab)[7:]]))  # every expert read in
        forward = Forward(model)
        out = []
        for start, end in plan(contexts, steps):
            begin = time.perf_counter()
            forward(torch.tensor([ids[start:end]]))
            grow_in_place(forward.cache)  # after a prefill, as generate_step does: decode appends into room
            prefill = time.perf_counter() - begin
            begin = time.perf_counter()
            for t in range(end, end + steps):
                forward(torch.tensor([[ids[t]]]))
            decode = time.perf_counter() - begin
            out.append({"context": end, "prefill_tokens": end - start, "prefill_seconds": prefill, "decode_seconds": decode})
    stats = moestream.stats(model)
    note = next((p["note"] for p in stats["fast_paths"] if p["name"] == "attention function"), "")
    moestream.close(model)
    return {"points": out, "note": note, "misses": stats["misses"]}


def run_llama_cpp(gguf: str, contexts: list[int], steps: int, threads: int, kv: str, flash: bool = True) -> dict:
    from llama_cpp import Llama

    q8 = 8  # GGML_TYPE_Q8_0
    extra = {"type_k": q8, "type_v": q8} if kv == "q8_0" else {}
    llm = Llama(
        model_path=gguf,
        n_ctx=contexts[-1] + steps + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=flash,
        use_mmap=True,
        verbose=False,
        **extra,
    )
    vocab = llm.n_vocab()
    ids = token_ids(contexts[-1] + steps, vocab)
    llm.eval(token_ids(WARMUP + 7, vocab)[7:])  # the whole file faulted in
    llm.reset()
    out = []
    for start, end in plan(contexts, steps):
        begin = time.perf_counter()
        llm.eval(ids[start:end])
        prefill = time.perf_counter() - begin
        begin = time.perf_counter()
        for t in range(end, end + steps):
            llm.eval([ids[t]])
        decode = time.perf_counter() - begin
        out.append({"context": end, "prefill_tokens": end - start, "prefill_seconds": prefill, "decode_seconds": decode})
    return {"points": out, "note": f"{'flash attention' if flash else 'no flash attention'}, KV {kv}"}


def worker(kind: str, argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", kind, *argv], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", nargs="?")
    parser.add_argument("gguf", nargs="?")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed at each context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory", default="6GiB", help="moestream's expert budget (holds every expert)")
    parser.add_argument("--engines", default="moestream,llama.cpp,moestream-int8,llama.cpp-q8_0")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        contexts, steps, threads = args.contexts, args.steps, args.threads
        if args.worker.startswith("moestream"):
            kv = "int8" if args.worker.endswith("int8") else "auto"
            result = run_moestream(args.store, args.memory, contexts, steps, threads, kv)
        else:
            kv = "q8_0" if args.worker.endswith("q8_0") else "f16"
            result = run_llama_cpp(args.gguf, contexts, steps, threads, kv, flash=not args.worker.endswith("nofa"))
        print(json.dumps(result))
        return
    sys.path.insert(0, str(HERE))
    import machine

    print(machine.line(), flush=True)

    common = [args.store, args.gguf, "--contexts", *map(str, args.contexts), "--steps", str(args.steps),
              "--threads", str(args.threads), "--memory", args.memory]  # fmt: skip
    results = {}
    for engine in args.engines.split(","):
        print(f"running {engine} ...", flush=True)
        results[engine] = worker(engine, common)
        print(
            f"  {results[engine]['note']}\n  {json.dumps(results[engine]['points'])}", flush=True
        )  # (kept if a later one fails)
    engines = list(results)
    print(f"\n{'context':>8} " + " ".join(f"{e:>16}" for e in engines) + "   (decode tok/s; prefill tok/s of each stretch)")
    for i, context in enumerate(args.contexts):
        decode = [args.steps / results[e]["points"][i]["decode_seconds"] for e in engines]
        prefill = [results[e]["points"][i]["prefill_tokens"] / results[e]["points"][i]["prefill_seconds"] for e in engines]
        print(f"{context:>8} " + " ".join(f"{d:>16.2f}" for d in decode) + "   decode")
        print(f"{'':>8} " + " ".join(f"{p:>16.1f}" for p in prefill) + "   prefill")
    for ours, theirs in (("moestream", "llama.cpp"), ("moestream-int8", "llama.cpp-q8_0"), ("moestream-int8", "llama.cpp")):
        if ours in results and theirs in results:
            for i, context in enumerate(args.contexts):
                a, b = results[ours]["points"][i], results[theirs]["points"][i]
                print(
                    f"{ours} / {theirs} at {context}: decode {b['decode_seconds'] / a['decode_seconds']:.2f}x, "
                    f"prefill of {a['prefill_tokens']} tokens {b['prefill_seconds'] / a['prefill_seconds']:.2f}x"
                )
    if args.json:
        machine.write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
