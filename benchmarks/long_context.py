"""Decode and prefill at long context, moestream against llama.cpp on the same model, in one command.

    python benchmarks/long_context.py STORE GGUF [--contexts 8192 16384 32768] [--steps 16] [--threads 2]

Each engine runs in a fresh process, one after another (moestream, llama.cpp, moestream with an 8-bit KV
cache, llama.cpp with q8_0 keys and values), and feeds the same token ids (random ones, or with `--text FILE`
a real text's, through the store's tokenizer, so that calibrated routers route as on text): a prompt of the first context's
length in one prefill (timed: the prefill figure), then `--steps` single-token decode steps (timed), then
the next stretch of ids as one more prefill up to the next context, `--steps` decode steps there, and so
on (moestream through the loop users run: each stretch a request whose prompt is the sequence so far,
its KV up to the stretch from the prefix cache, as an agent's next turn). Decode steps are teacher-forced from the same ids (a step costs the same whatever its token is, and
both engines then hold the same sequence). Every expert is in memory before anything is timed: moestream
prefills a 512-token warm-up prompt first (it routes to every expert) with a budget that holds them all,
and decodes its last 4 tokens one at a time (a first one-token step checks the fused kernels once per
layer); llama.cpp evaluates the same warm-up the same way (faulting its mmap'd file in). llama.cpp runs with flash attention
(its long-context setting, and what its quantized V cache needs) and a prefill batch of 512; the engine
`llama.cpp-nofa` runs it without (llama-cpp-python's default). llama.cpp uses its mmap'd file; an engine
name with `-copy` (`llama.cpp-nofa-copy`) loads it with `use_mmap=False` instead: its own copy of the weights,
repacked for this CPU (its fastest decode where the file fits in RAM twice over).

A full-depth model (48 layers, `gguf_more_layers.py`, every expert in RAM):

    python benchmarks/long_context.py STORE GGUF --text TEXT --contexts 32 4096 --steps 32 --memory 17GiB \
        --engines moestream,llama.cpp-nofa-copy,llama.cpp-nofa

The engine `moestream-loops` runs moestream with the blocked prefill loops off (native/lowbit_gemm.h: the
decode-shaped loops at every row count, and "auto" activations chosen by them), beside `moestream`;
`moestream-sdpa` with the prefill attention kernel off (native/prefill_attention.h: prompts through torch's
sdpa, as a CPU without AVX-512 BF16 runs them).

Needs llama-cpp-python (a benchmark tool, not a dependency). Prints a table per context and the ratios;
`--json FILE` writes them with the machine's record; `--record` writes the two tables as this machine's
record of long-context (`--record full-depth` for a 48-layer run; benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import machine  # noqa: E402

WARMUP = 512
WARM_STEPS = 4  # single-token steps at the warm-up's end: a first decode step's one-time work is not timed
SEED = 1234


def token_ids(n: int, vocab: int, text: str | None = None, store: str | None = None, skip: int = 0) -> list[int]:
    """n ids: random ones (below `vocab`), or the text's from its token `skip` on, tokenized as the store does."""
    import torch

    if text is None:
        return torch.randint(3, vocab, (skip + n,), generator=torch.Generator().manual_seed(SEED)).tolist()[skip:]
    from moestream.core.loading import load_tokenizer

    ids = load_tokenizer(store)(Path(text).read_text()).input_ids[skip : skip + n]
    if len(ids) < n:
        sys.exit(f"long_context: {text} has fewer than {skip + n} tokens")
    return ids


def warmup_and_measured_ids(
    args_text: str | None, store: str, vocab: int, warmup: int, total: int
) -> tuple[list[int], list[int]]:
    """The warm-up prompt's ids and the measured ones: with a text, the warm-up is the text after the measured span."""
    if args_text is None:
        return token_ids(warmup, vocab, skip=7), token_ids(total, vocab)
    return token_ids(warmup, vocab, args_text, store, skip=total), token_ids(total, vocab, args_text, store)


def plan(contexts: list[int], steps: int) -> list[tuple[int, int]]:
    """(start, end) of each prefill stretch: the first from 0, each next one after the previous decode steps."""
    stretches, fed = [], 0
    for context in contexts:
        stretches.append((fed, context))
        fed = context + steps
    return stretches


def run_moestream(
    store: str, memory: str, contexts: list[int], steps: int, threads: int, kv: str, text: str | None, warmup: int
) -> dict:
    import torch

    import moestream
    from moestream.generation.generate import SamplingParams
    from moestream.generation.kv_cache import PrefixCache
    from moestream.generation.serving import stream, teacher_forced

    torch.set_num_threads(threads)
    model, _ = moestream.load(store, memory, kv_cache_dtype=kv, prefetch="off")
    warm, ids = warmup_and_measured_ids(text, store, model.config.vocab_size, warmup, contexts[-1] + steps)
    # every expert read in, and the one-token kernels' first-call checks done
    teacher_forced(model, warm, prefill=len(warm) - WARM_STEPS)
    # Each stretch is a request of the loop users run, as an agent's next turn is: its prompt is the whole
    # sequence so far, whose KV up to the stretch the prefix cache holds (so only the stretch is prefilled,
    # in one pass), then `steps` tokens teacher-forced one at a time; its KV goes back into the cache.
    prefixes = PrefixCache(budget_bytes=1 << 60)
    out = []
    for start, end in plan(contexts, steps):
        forced = ids[end : end + steps] + [0]  # the last token is chosen, never fed
        reused = prefixes.stats().tokens_reused
        timing = stream(model, None, ids[:end], SamplingParams.timed(steps + 1, forced), prefix_cache=prefixes).timing
        prefill, decode = timing.time_to_first_token, timing.decode_seconds
        if prefixes.stats().tokens_reused - reused != start:
            sys.exit(f"long_context: the stretch from {start} to {end} did not start from the cached {start} tokens")
        out.append({"context": end, "prefill_tokens": end - start, "prefill_seconds": prefill, "decode_seconds": decode})
    stats = moestream.stats(model)
    note = "; ".join(p["note"] for p in stats["fast_paths"] if p["name"] in ("attention function", "low-bit matmuls"))
    moestream.close(model)
    return {"points": out, "note": note, "misses": stats["misses"]}


def run_llama_cpp(
    gguf: str,
    store: str,
    contexts: list[int],
    steps: int,
    threads: int,
    kv: str,
    flash: bool,
    copy: bool,
    text: str | None,
    warmup: int,
) -> dict:
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
        use_mmap=not copy,
        verbose=False,
        **extra,
    )
    warm, ids = warmup_and_measured_ids(text, store, llm.n_vocab(), warmup, contexts[-1] + steps)
    llm.eval(warm[:-WARM_STEPS])  # the whole file faulted in
    for token in warm[-WARM_STEPS:]:  # and single-token steps run, as moestream's warm-up does
        llm.eval([token])
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
    weights = "its own repacked copy (use_mmap=False)" if copy else "mmap"
    return {"points": out, "note": f"{'flash attention' if flash else 'no flash attention'}, KV {kv}, weights: {weights}"}


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
    parser.add_argument("--text", help="feed this text's tokens (teacher-forced) instead of random ids")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="tokens of the untimed warm-up prompt")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    machine.add_record_argument(parser, "long-context")
    args = parser.parse_args()
    if args.worker:
        contexts, steps, threads, flags = args.contexts, args.steps, args.threads, args.worker.split("-")
        if flags[0] == "moestream":
            kv = "int8" if "int8" in flags else "auto"
            if "loops" in flags:  # the blocked prefill loops off: the decode-shaped loops at every row count
                from moestream.native import fused_build

                if (ext := fused_build.extension()) is not None:
                    ext.lowbit_gemm_rows(1 << 40)
            if "sdpa" in flags:  # the prefill attention kernel off: prompts through torch's sdpa
                from moestream.native import fused_build

                if (ext := fused_build.extension()) is not None:
                    ext.prefill_attention_switch(False)
            result = run_moestream(args.store, args.memory, contexts, steps, threads, kv, args.text, args.warmup)
        else:
            kv = "q8_0" if "q8_0" in flags else "f16"
            flash, copy = "nofa" not in flags, "copy" in flags
            result = run_llama_cpp(args.gguf, args.store, contexts, steps, threads, kv, flash, copy, args.text, args.warmup)
        print(json.dumps(result))
        return
    print(machine.line(), flush=True)

    common = [args.store, args.gguf, "--contexts", *map(str, args.contexts), "--steps", str(args.steps),
              "--threads", str(args.threads), "--memory", args.memory, "--warmup", str(args.warmup)]  # fmt: skip
    if args.text:
        common += ["--text", args.text]
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
    pairs = [
        (ours, theirs) for ours in engines if ours.startswith("moestream") for theirs in engines if theirs.startswith("llama.cpp")
    ]
    for ours, theirs in pairs:
        for i, context in enumerate(args.contexts):
            a, b = results[ours]["points"][i], results[theirs]["points"][i]
            print(
                f"{ours} / {theirs} at {context}: decode {b['decode_seconds'] / a['decode_seconds']:.2f}x, "
                f"prefill of {a['prefill_tokens']} tokens {b['prefill_seconds'] / a['prefill_seconds']:.2f}x"
            )
    if args.json:
        machine.write_json(args.json, {"args": vars(args), "results": results})
    if args.record:
        record(args, results, pairs)


def record(args, results: dict, pairs: list[tuple[str, str]]) -> None:
    engines, points = list(results), range(len(args.contexts))
    decode, prefill = [], []
    for i in points:
        p = {e: results[e]["points"][i] for e in engines}
        decode.append(
            [f"{args.contexts[i]:,}"]
            + [f"{args.steps / p[e]['decode_seconds']:.2f}" for e in engines]
            + [f"{p[b]['decode_seconds'] / p[a]['decode_seconds']:.2f}x" for a, b in pairs]
        )
        prefill.append(
            [f"{args.contexts[i]:,}", f"{p[engines[0]]['prefill_tokens']:,}"]
            + [f"{p[e]['prefill_tokens'] / p[e]['prefill_seconds']:.1f}" for e in engines]
            + [f"{p[b]['prefill_seconds'] / p[a]['prefill_seconds']:.2f}x" for a, b in pairs]
        )
    fed = "real text teacher-forced" if args.text else "random ids"
    ratios = [f"{a} / {b}" for a, b in pairs]
    tables = [
        machine.table(
            f"Decode tok/s after each context ({args.steps} steps, {fed}, `--memory {args.memory}`, {args.threads} threads; one run, the engines in turn):",
            ["context", *engines, *ratios],
            decode,
        ),
        machine.table(
            "Prefill tok/s of each stretch up to the context:", ["context", "stretch tokens", *engines, *ratios], prefill
        ),
    ]
    notes = "; ".join(f"{e}: {results[e]['note']}" for e in engines if "note" in results[e])
    path = machine.write_result(args.record, "Long context against llama.cpp", machine.invocation(), tables, notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
