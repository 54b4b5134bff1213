"""moestream against llama.cpp on a model of Qwen3-30B-A3B's shape, from nothing, in one command.

    python benchmarks/real_shape.py WORKDIR --llama-cpp /path/to/llama_cpp_python-0.3.36 [--rounds 3] [--profile]
    python benchmarks/real_shape.py WORKDIR --convert-args "--dense-dtype int8"   # another store beside the first
    python benchmarks/real_shape.py WORKDIR --profile-only                         # just the per-op profile

Each step is skipped when its output exists in WORKDIR (keep WORKDIR outside the repository; it needs
about 25 GB, 13 GB after --delete-bf16-gguf):

1. `checkpoint/`: `make_synthetic_checkpoint.py --shape qwen3-30b-a3b` (qwen3_moe, hidden 2048, 32/4
   heads of 128, 128 experts of width 768, top-8, 8 layers, byte-level vocabulary, random bf16: 9.3 GiB).
2. `store-int4[-...]/`: `moestream convert checkpoint STORE --experts-dtype int4 [--convert-args]`; the
   store's name carries the extra arguments, so stores of different options sit side by side.
3. `model-bf16.gguf` with llama.cpp's own converter (`to_gguf.py`), then `model-q4_0.gguf` with
   llama.cpp's quantizer (`llama_model_quantize` of llama-cpp-python, LLAMA_FTYPE_MOSTLY_Q4_0);
   `--delete-bf16-gguf` removes the bf16 file once the Q4_0 one exists. `--llama-cpp` is a source tree
   with `vendor/llama.cpp/convert_hf_to_gguf.py` (or a llama.cpp tree itself).
4. The comparison, moestream and llama.cpp in the same run, so that a busy machine slows both:
   - `moestream bench STORE --memory 6GiB --compare-gguf Q4_0 --new-tokens 64`: decode (bench's
     all-hits compute line is the cached-experts figure) and `--prompt-tokens 512 --new-tokens 8`: TTFT of
     a long prompt. bench's moestream run starts with a cold cache, llama.cpp's with whatever of the file
     the page cache holds.
   - `--rounds` alternating fresh processes, both warm: moestream after a pass that caches every expert,
     llama.cpp after a pass that faults its whole file in. Each measures decode tok/s (N tokens after a
     32-token prompt), prefill tok/s of a 512-token prompt (512 / TTFT) and peak RSS; printed per round
     with the ratios moestream / llama.cpp and their medians. Same random prompt ids, greedy, the same
     number of threads (`--threads`, default all cores).
5. `--profile`: torch.profiler over moestream's all-hits decode (after the same warm-up), ops grouped by
   name, the top ones with their share of the profiled ops' total, and the wall time no op accounts for
   (Python, the engine's bookkeeping).

Results go to WORKDIR/results/*.json (with the machine: CPU, torch, commit) as well as to the terminal;
`--record` also writes the warm rounds as this machine's record of decode-30b-shape (`--record
real-vocabulary` or `--record small-model` for those checkpoints; benchmarks/machine.py).

llama.cpp must run here before anything is timed, so a short llama.cpp generation goes first: `moestream
bench` waits forever for a peer process that dies. One way it dies: a build with GGML_NATIVE (pip's
default) on a CPU that lists AMX where the kernel (here, a sandbox) does not let a process use it
traps with SIGILL at the first matmul. Then build the CPU backend without AMX, from the same source,
and pass its directory as --llama-lib (it goes first on LD_LIBRARY_PATH of every child process; the
other libraries stay the installed ones):

    cmake -S SRC/vendor/llama.cpp -B ggml-noamx -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON \
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
    ninja -C ggml-noamx ggml-cpu && mkdir llama-lib && cp -L ggml-noamx/bin/libggml-cpu.so.0 llama-lib/
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import machine

HERE = Path(__file__).resolve().parent
PROMPT_SEED = 0
LONG_PROMPT = 512
SHORT_PROMPT = 32


def log(message: str) -> None:
    print(f"[real_shape {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_step(name: str, command: list[str], timings: dict, env: dict | None = None) -> None:
    log(f"{name}: {shlex.join(command)}" + "".join(f" ({k}={v})" for k, v in (env or {}).items()))
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, **(env or {})})
    timings[name] = time.perf_counter() - start
    log(f"{name}: {timings[name]:.0f} s")


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def llama_cpp_tree(path: str | None) -> Path:
    if not path:
        sys.exit("real_shape: --llama-cpp names the llama.cpp source tree that makes the GGUFs")
    root = Path(path).resolve()
    for candidate in (root, root / "vendor" / "llama.cpp"):
        if (candidate / "convert_hf_to_gguf.py").is_file():
            return candidate
    sys.exit(f"real_shape: no convert_hf_to_gguf.py in {root} or {root / 'vendor' / 'llama.cpp'}")


def store_name(experts_dtype: str, convert_args: list[str]) -> str:
    extra = "-".join(re.sub(r"[^A-Za-z0-9.]+", "", a) for a in convert_args if a.strip("-"))
    return f"store-{experts_dtype}" + (f"-{extra}" if extra else "")


def prompt_ids(n: int) -> list[int]:
    import torch

    from moestream.conversion.synthetic import VOCAB_SIZE

    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(PROMPT_SEED)).tolist()


# ---- build steps ----


def build(args, work: Path, timings: dict) -> tuple[Path, Path]:
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").is_file():
        partial = work / "checkpoint.partial"
        command = [sys.executable, str(HERE / "make_synthetic_checkpoint.py"), str(partial), "--shape", "qwen3-30b-a3b"]
        if args.zipf:
            command += ["--zipf", str(args.zipf)]
        command += shlex.split(args.checkpoint_args)
        run_step("checkpoint", command, timings)
        partial.rename(checkpoint)
    store = work / store_name(args.experts_dtype, args.convert_args)
    if not store.is_dir():  # convert makes the store directory only when it is complete
        command = ["moestream", "convert", str(checkpoint), str(store), "--experts-dtype", args.experts_dtype, *args.convert_args]
        run_step("convert", command, timings)
    q4 = work / "model-q4_0.gguf"
    bf16 = work / "model-bf16.gguf"
    if not q4.is_file():
        if not bf16.is_file():
            tree = llama_cpp_tree(args.llama_cpp)
            partial = work / "model-bf16.gguf.partial"
            command = [sys.executable, str(HERE / "to_gguf.py"), "--llama-cpp", str(tree), str(checkpoint)]
            run_step("gguf-bf16", [*command, "--outtype", "bf16", "--outfile", str(partial)], timings)
            partial.rename(bf16)
        run_step("gguf-q4_0", [sys.executable, __file__, "worker", "quantize", str(bf16), str(q4)], timings)
    if args.delete_bf16_gguf and bf16.is_file():
        bf16.unlink()
        log(f"deleted {bf16}")
    return store, q4


def quantize(src: str, dst: str, ftype: str = "Q4_0") -> None:
    """llama.cpp's own quantizer (llama-quantize's function) through llama-cpp-python's bindings; `ftype`
    is llama.cpp's name of the mix (Q4_0, Q4_K_M, Q3_K_M, Q2_K, ...):

        python benchmarks/real_shape.py worker quantize model-bf16.gguf model-q4_k_m.gguf Q4_K_M
    """
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = os.cpu_count() or 1
    partial = dst + ".partial"
    rc = llama_cpp.llama_model_quantize(src.encode(), partial.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"real_shape: llama_model_quantize returned {rc}")
    os.rename(partial, dst)


# ---- warm measurements, one fresh process per engine and round ----


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_moestream(store: str, memory: str, new_tokens: int, threads: int, prefetch: str, activations: str = "auto") -> dict:
    import torch

    import moestream
    from moestream.generation.serving import timed

    torch.set_num_threads(threads)
    long, short = torch.tensor([prompt_ids(LONG_PROMPT)]), torch.tensor([prompt_ids(SHORT_PROMPT)])
    start = time.perf_counter()
    model, _ = moestream.load(store, memory, prefetch=prefetch, activations=activations)
    load_seconds = time.perf_counter() - start
    paths = moestream.stats(model)["fast_paths"]
    timed(model, long, 2)  # reads every expert a 512-token prompt routes to: all of them, in practice
    timed(model, short, new_tokens)  # and any the decode needs besides
    before = moestream.stats(model)
    prefill = timed(model, long, 2).timing
    decode = timed(model, short, new_tokens).timing
    after = moestream.stats(model)
    moestream.close(model)
    misses = after["misses"] - before["misses"]
    return dict(
        load_seconds=load_seconds,
        ttft_seconds=prefill.time_to_first_token,
        prefill_tokens_per_second=LONG_PROMPT / prefill.time_to_first_token,
        decode_tokens_per_second=decode.decode_tokens_per_second,
        misses_while_measured=misses,
        cached_experts=after["cached_experts"],
        peak_rss_bytes=peak_rss(),
        low_bit_matmuls=next((p["note"] for p in paths if p["name"] == "low-bit matmuls"), ""),
    )


def measure_llama_cpp(gguf: str, new_tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    long, short = prompt_ids(LONG_PROMPT), prompt_ids(SHORT_PROMPT)
    start = time.perf_counter()
    llm = Llama(
        model_path=gguf,
        n_ctx=LONG_PROMPT + new_tokens + 8,
        n_batch=LONG_PROMPT,
        n_threads=threads,
        n_threads_batch=threads,
        use_mmap=True,
        verbose=False,
    )
    load_seconds = time.perf_counter() - start

    def generate(ids: list[int], n: int) -> tuple[float, float]:
        llm.reset()
        begin = time.perf_counter()
        llm.eval(ids)
        token = llm.sample(temp=0.0)
        first = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        end = time.perf_counter()
        return first - begin, (n - 1) / (end - first) if n > 1 else 0.0

    generate(long, 2)  # faults the whole file in (every expert is routed to)
    generate(short, new_tokens)
    ttft, _ = generate(long, 2)
    _, decode = generate(short, new_tokens)
    return dict(
        load_seconds=load_seconds,
        ttft_seconds=ttft,
        prefill_tokens_per_second=LONG_PROMPT / ttft,
        decode_tokens_per_second=decode,
        peak_rss_bytes=peak_rss(),
    )


def check_llama_cpp(gguf: str, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=64, n_threads=threads, use_mmap=True, verbose=False)
    llm.eval(prompt_ids(8))
    return {"token": int(llm.sample(temp=0.0))}


def worker_call(kind: str, *argv: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "worker", kind, *argv], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def side_by_side(args, store: Path, q4: Path) -> dict:
    threads = str(args.threads)
    rounds = []
    print(
        f"\nwarm side by side: decode {args.new_tokens} tokens after a {SHORT_PROMPT}-token prompt, prefill of "
        f"{LONG_PROMPT} tokens, {args.threads} threads, moestream --memory {args.memory} --prefetch {args.prefetch}"
    )
    header = (
        f"{'round':>5} {'engine':<10} {'decode tok/s':>12} {'prefill tok/s':>13} {'TTFT s':>7} {'peak RSS':>10} {'load s':>7}"
    )
    print(header, flush=True)
    modes = args.activations.split(",")
    ours_names = ["moestream" if len(modes) == 1 else f"ms:{mode}" for mode in modes]
    for i in range(args.rounds):
        runs = {}
        for name, mode in zip(ours_names, modes):
            runs[name] = worker_call("moestream", str(store), args.memory, str(args.new_tokens), threads, args.prefetch, mode)
        runs["llama.cpp"] = theirs = worker_call("llama.cpp", str(q4), str(args.new_tokens), threads)
        for name, r in runs.items():
            print(
                f"{i + 1:>5} {name:<10} {r['decode_tokens_per_second']:>12.2f} {r['prefill_tokens_per_second']:>13.1f} "
                f"{r['ttft_seconds']:>7.2f} {gib(r['peak_rss_bytes']):>10} {r['load_seconds']:>7.1f}"
                + (f"  ({r['misses_while_measured']} misses while measured)" if r.get("misses_while_measured") else "")
                + (f"  [{r['low_bit_matmuls']}]" if r.get("low_bit_matmuls") else ""),
                flush=True,
            )
        ratio = {
            name: {
                "decode": runs[name]["decode_tokens_per_second"] / theirs["decode_tokens_per_second"],
                "prefill": runs[name]["prefill_tokens_per_second"] / theirs["prefill_tokens_per_second"],
            }
            for name in ours_names
        }
        for name in ours_names:
            print(f"{'':>5} ratio {name} / llama.cpp: decode {ratio[name]['decode']:.2f}x, prefill {ratio[name]['prefill']:.2f}x")
        rounds.append({**runs, "ratio": ratio})
    summary = {}
    for key in ("decode", "prefill"):
        for name in ours_names:
            summary[f"{name}_{key}_ratio_median"] = statistics.median(r["ratio"][name][key] for r in rounds)
        for engine in ours_names + ["llama.cpp"]:
            summary[f"{engine}_{key}_median"] = statistics.median(r[engine][f"{key}_tokens_per_second"] for r in rounds)
    for name in ours_names:
        print(
            f"medians over {len(rounds)} rounds: decode {name} {summary[f'{name}_decode_median']:.2f} / llama.cpp "
            f"{summary['llama.cpp_decode_median']:.2f} tok/s, per-round ratio {summary[f'{name}_decode_ratio_median']:.2f}x; "
            f"prefill {name} {summary[f'{name}_prefill_median']:.1f} / llama.cpp {summary['llama.cpp_prefill_median']:.1f} "
            f"tok/s, per-round ratio {summary[f'{name}_prefill_ratio_median']:.2f}x",
            flush=True,
        )
    return {"rounds": rounds, "summary": summary}


def record(args, store: Path, side: dict) -> None:
    """The warm rounds as the document's table: per round each moestream mode against llama.cpp."""
    names = [n for n in side["rounds"][0] if n not in ("llama.cpp", "ratio")]
    rows = []
    for i, r in enumerate(side["rounds"]):
        theirs = r["llama.cpp"]
        for name in names:
            ours, ratio = r[name], r["ratio"][name]
            rows.append(
                [i + 1, *([name] if len(names) > 1 else []), f"{ours['decode_tokens_per_second']:.2f}", f"{theirs['decode_tokens_per_second']:.2f}",
                 f"{ratio['decode']:.2f}x", f"{ours['prefill_tokens_per_second']:.1f} / {theirs['prefill_tokens_per_second']:.1f}", f"{ratio['prefill']:.2f}x"]
            )  # fmt: skip
    columns = ["round", *(["moestream"] if len(names) > 1 else []), "moestream tok/s", "llama.cpp tok/s", "decode ratio"]
    columns += ["prefill tok/s moestream / llama.cpp", "prefill ratio"]
    caption = (
        f"Store `{store.name}` against llama.cpp's Q4_0 file, warm, alternating fresh processes: decode {args.new_tokens} tokens after a "
        f"{SHORT_PROMPT}-token prompt, prefill of {LONG_PROMPT} tokens, {args.threads} threads, moestream `--memory {args.memory} "
        f"--prefetch {args.prefetch} --activations {args.activations}`:"
    )
    s = side["summary"]
    notes = " ".join(
        f"Medians of the per-round ratios ({name}): decode **{s[f'{name}_decode_ratio_median']:.2f}x**, prefill **{s[f'{name}_prefill_ratio_median']:.2f}x**."
        for name in names
    )
    title = "Decode and prefill against llama.cpp at the Qwen3-30B-A3B shape"
    path = machine.write_result(args.record, title, machine.invocation(), [machine.table(caption, columns, rows)], notes)
    log(f"wrote {path}")


# ---- per-op profile of all-hits decode ----


def profile_moestream(
    store: str, memory: str, new_tokens: int, threads: int, prefetch: str, top: int, activations: str = "auto"
) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import moestream
    from moestream.generation.serving import timed

    torch.set_num_threads(threads)
    long, short = torch.tensor([prompt_ids(LONG_PROMPT)]), torch.tensor([prompt_ids(SHORT_PROMPT)])
    model, _ = moestream.load(store, memory, prefetch=prefetch, activations=activations)
    timed(model, long, 2)
    timed(model, short, new_tokens)
    plain = timed(model, short, new_tokens).timing.decode_tokens_per_second
    before = moestream.stats(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        timing = timed(model, short, new_tokens).timing
        wall = time.perf_counter() - start
    misses = moestream.stats(model)["misses"] - before["misses"]
    moestream.close(model)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    rows = [
        dict(
            op=e.key,
            calls=e.count,
            self_ms=e.self_cpu_time_total / 1e3,
            share=e.self_cpu_time_total / total_us,
            per_token_ms=e.self_cpu_time_total / 1e3 / new_tokens,
        )
        for e in events
    ]
    return dict(
        new_tokens=new_tokens,
        decode_tokens_per_second=plain,
        decode_tokens_per_second_profiled=timing.decode_tokens_per_second,
        wall_seconds=wall,
        ops_self_seconds=total_us / 1e6,
        misses_while_profiled=misses,
        top=rows[:top],
        rest_share=sum(r["share"] for r in rows[top:]),
    )


def print_profile(p: dict) -> None:
    print(
        f"\nper-op profile of all-hits decode ({p['new_tokens']} tokens after a {SHORT_PROMPT}-token prompt; "
        f"{p['misses_while_profiled']} misses): {p['decode_tokens_per_second']:.2f} tok/s unprofiled, "
        f"{p['decode_tokens_per_second_profiled']:.2f} under the profiler"
    )
    print(
        f"wall {p['wall_seconds']:.2f} s (prefill of the prompt included), ops' self CPU time {p['ops_self_seconds']:.2f} s "
        f"({p['ops_self_seconds'] / p['wall_seconds']:.0%} of wall; the rest is Python and the engine outside torch ops)"
    )
    print(f"{'op':<40} {'calls':>8} {'self ms':>10} {'ms/token':>9} {'share':>7}")
    for r in p["top"]:
        print(f"{r['op'][:40]:<40} {r['calls']:>8} {r['self_ms']:>10.1f} {r['per_token_ms']:>9.2f} {r['share']:>7.1%}")
    print(f"{'(all other ops)':<40} {'':>8} {'':>10} {'':>9} {p['rest_share']:>7.1%}", flush=True)


# ---- the command ----


def bench(args, store: Path, q4: Path, results: Path, timings: dict) -> dict:
    reports = {}
    for name, extra in (
        ("decode", ["--new-tokens", str(args.new_tokens)]),
        ("prefill", ["--prompt-tokens", str(LONG_PROMPT), "--new-tokens", "8"]),
    ):
        out = results / f"bench-{store.name}-{name}.json"
        command = ["moestream", "bench", str(store), "--memory", args.memory, "--compare-gguf", str(q4), *extra]
        # bench gives llama.cpp torch's thread count, which OMP_NUM_THREADS sets: the same for both
        run_step(f"bench-{name}", [*command, "--json", str(out)], timings, {"OMP_NUM_THREADS": str(args.threads)})
        reports[name] = json.loads(out.read_text())
    d = reports["decode"]
    all_hits = 1 / d["all_hits_seconds_per_token"] if d["all_hits_seconds_per_token"] else 0.0
    llama = next((p for p in d["peers"] if p["name"].startswith("llama.cpp")), None)
    if llama and llama["decode_tokens_per_second"]:
        print(
            f"bench: moestream all-hits {all_hits:.2f} tok/s ({'measured' if d['all_hits_measured'] else 'estimated'}), "
            f"llama.cpp {llama['decode_tokens_per_second']:.2f} tok/s: {all_hits / llama['decode_tokens_per_second']:.2f}x",
            flush=True,
        )
    return reports


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        kind, argv = sys.argv[2], sys.argv[3:]
        if kind == "quantize":
            quantize(*argv)
            return
        if kind == "check-llama.cpp":
            result = check_llama_cpp(argv[0], int(argv[1]))
        elif kind == "moestream":
            result = measure_moestream(argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5])
        elif kind == "llama.cpp":
            result = measure_llama_cpp(argv[0], int(argv[1]), int(argv[2]))
        else:
            result = profile_moestream(argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], int(argv[5]), argv[6])
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", help="where the checkpoint, stores, GGUFs and results live (outside the repo)")
    parser.add_argument("--llama-cpp", help="llama.cpp source tree (needed to make the GGUFs)")
    parser.add_argument("--llama-lib", help="a directory put first on LD_LIBRARY_PATH (a rebuilt libggml-cpu.so.0)")
    parser.add_argument("--experts-dtype", default="int4")
    parser.add_argument("--convert-args", default="", help='more `moestream convert` options, e.g. "--dense-dtype int8"')
    parser.add_argument("--checkpoint-args", default="", help='overrides of the preset, e.g. "--layers 4" (a new WORKDIR)')
    parser.add_argument("--zipf", type=float, default=0.0, help="skew the checkpoint's routers (a new WORKDIR)")
    parser.add_argument("--delete-bf16-gguf", action="store_true", help="remove model-bf16.gguf once Q4_0 exists")
    parser.add_argument("--memory", default="6GiB", help="moestream's expert budget (holds every int4 expert)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="warm side-by-side rounds (0: none)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prefetch", default="off", help="moestream --prefetch in the warm runs and the profile")
    parser.add_argument(
        "--activations",
        default="auto",
        help="moestream's --activations in the warm runs; several, comma-separated (int8,float), run side by side "
        "in each round (the profile takes the first)",
    )
    parser.add_argument("--no-bench", action="store_true", help="skip the two `moestream bench` runs")
    parser.add_argument("--profile", action="store_true", help="also profile moestream's all-hits decode")
    parser.add_argument("--profile-only", action="store_true", help="build if needed, then only the profile")
    parser.add_argument("--top", type=int, default=12, help="ops in the profile table")
    machine.add_record_argument(parser, "decode-30b-shape")
    args = parser.parse_args()
    args.convert_args = shlex.split(args.convert_args)
    if args.llama_lib:
        lib = str(Path(args.llama_lib).resolve())
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))
    work = Path(args.workdir).resolve()
    results = work / "results"
    results.mkdir(parents=True, exist_ok=True)
    timings: dict = {}
    store, q4 = build(args, work, timings)
    artifacts = {
        p.name: tree_bytes(p) for p in sorted(work.iterdir()) if p.name != "results" and p.suffix not in (".partial", ".log")
    }
    print("\nartifacts: " + ", ".join(f"{name} {gib(n)}" for name, n in artifacts.items()), flush=True)
    report: dict = {"store": str(store), "gguf": str(q4), "artifacts_bytes": artifacts, "step_seconds": timings}
    print(f"machine: {machine.line()}", flush=True)
    tag = f"{store.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not args.profile_only:
        try:
            worker_call("check-llama.cpp", str(q4), str(args.threads))
        except subprocess.CalledProcessError as e:
            sys.exit(f"real_shape: llama.cpp cannot run {q4} here ({e}); see --llama-lib in --help")
        if not args.no_bench:
            report["bench"] = bench(args, store, q4, results, timings)
        if args.rounds:
            start = time.perf_counter()
            report["side_by_side"] = side_by_side(args, store, q4)
            timings["side-by-side"] = time.perf_counter() - start
            if args.record:
                record(args, store, report["side_by_side"])
    if args.profile or args.profile_only:
        start = time.perf_counter()
        argv = [str(store), args.memory, str(args.new_tokens), str(args.threads), args.prefetch, str(args.top)]
        argv.append(args.activations.split(",")[0])
        report["profile"] = worker_call("profile", *argv)
        timings["profile"] = time.perf_counter() - start
        print_profile(report["profile"])
    out = results / f"real_shape-{tag}.json"
    machine.write_json(out, report)
    print("\nstep seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
