"""moestream's batched decoding in one process, against each prompt alone and against transformers' own
continuous batching (`model.generate_batch`, paged attention) on the same loaded model.

    python benchmarks/batching_check.py STORE --memory 8MiB --prompts heldout.txt [--compute-dtype fp32] [--json OUT]

1. Exactness: --count prompts (paragraphs of --prompts, their first 200 characters), --tokens greedy
   tokens each, decoded alone (`serving.stream`) and --batches at a time (`moestream.generate_batch`):
   how many equal, and where the others part.
2. Speed: the same prompts all at once, moestream's `generate_batch` and transformers' `generate_batch`
   (end-of-sequence disabled in both), alternating for --rounds rounds: aggregate tok/s (tokens over the
   wall time of the call, prefills included), and how many of transformers' answers equal moestream's.
3. A long prompt joining (--long-prompt N tokens of the text): two sequences decode while a newcomer with
   an N-token prompt joins; the running sequences' longest gap between two tokens and the newcomer's
   prefill time, with its prompt fed in parts of --chunk tokens per step and in one pass.
--json writes the same figures with the machine.
"""

import argparse
import time

import machine
from transformers import GenerationConfig

import moestream
from moestream.generation.batching import BatchGenerator
from moestream.generation.generate import Decoding, SamplingParams
from moestream.generation.serving import stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store")
    parser.add_argument("--memory", default="8MiB")
    parser.add_argument("--prompts", required=True, help="a text file; its paragraphs are the prompts")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batches", default="4,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compute-dtype", default="auto")
    parser.add_argument("--long-prompt", type=int, default=0, help="part 3: the newcomer's prompt length (0: skip)")
    parser.add_argument("--chunk", type=int, default=256, help="part 3: prompt tokens fed per step (against one pass)")
    parser.add_argument("--json", help="write the figures here too")
    machine.add_record_argument(parser, "batching-exactness")
    args = parser.parse_args()

    model, tokenizer = moestream.load(args.store, memory=args.memory, compute_dtype=args.compute_dtype)
    paragraphs = [p.strip()[:200] for p in open(args.prompts).read().split("\n\n") if p.strip()]
    prompts = [tokenizer(p)["input_ids"] for p in paragraphs[: args.count]]
    n = args.tokens
    print(f"machine: {machine.line()}")
    print(f"{args.store}, --memory {args.memory}, compute dtype {model.dtype}, {len(prompts)} prompts x {n} greedy tokens")
    report: dict = {
        "compute_dtype": str(model.dtype),
        "prompts": len(prompts),
        "tokens": n,
        "exact": {},
        "speed": [],
        "joining": {},
    }

    solo = [stream(model, None, p, SamplingParams.timed(n)).token_ids for p in prompts]
    for batch in (int(b) for b in args.batches.split(",")):
        together = moestream.generate_batch(model, None, prompts, SamplingParams.timed(n), max_batch=batch)
        parted = [next((i for i, (a, b) in enumerate(zip(x, r.token_ids)) if a != b), None) for x, r in zip(solo, together)]
        report["exact"][batch] = {"equal": sum(p is None for p in parted), "part_at": sorted(p for p in parted if p is not None)}
        print(
            f"  {batch} at a time: {sum(p is None for p in parted)} of {len(prompts)} equal their solo answers"
            + (
                f"; the others part at tokens {sorted(p for p in parted if p is not None)}"
                if any(p is not None for p in parted)
                else ""
            )
        )

    config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    for r in range(args.rounds):
        start = time.perf_counter()
        ours = moestream.generate_batch(model, None, prompts, SamplingParams.timed(n), max_batch=len(prompts))
        mine = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=config, progress_bar=False)
        theirs_seconds = time.perf_counter() - start
        theirs = [list(out[k].generated_tokens) for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]))]
        same = sum(a.token_ids == b for a, b in zip(ours, theirs))
        total = len(prompts) * n
        report["speed"].append({"moestream_tok_s": total / mine, "transformers_tok_s": total / theirs_seconds, "equal": same})
        print(
            f"  round {r + 1}, all {len(prompts)} at once: moestream {total / mine:.1f} tok/s, transformers' generate_batch "
            f"{total / theirs_seconds:.1f} tok/s ({mine / theirs_seconds:.2f}x its time); its answers equal moestream's: "
            f"{same} of {len(prompts)}"
        )
    if args.long_prompt:
        text_ids = tokenizer(open(args.prompts).read())["input_ids"]
        long = text_ids[: args.long_prompt]
        for chunk in (args.chunk, None):
            runs = [joining(model, prompts[:2], long, chunk) for _ in range(max(1, args.rounds))]
            label = f"in parts of {chunk} tokens" if chunk else "in one pass"
            report["joining"][label] = [{"longest_gap_s": gap, "prefill_s": prefill} for gap, prefill in runs]
            print(
                f"  a {len(long)}-token prompt joining two decoding sequences, {label}: their longest gap between tokens "
                + ", ".join(f"{gap * 1e3:.0f}" for gap, _ in runs)
                + " ms; the newcomer's prefill "
                + ", ".join(f"{prefill * 1e3:.0f}" for _, prefill in runs)
                + " ms"
            )
    moestream.close(model)
    if args.json:
        machine.write_json(args.json, {"store": args.store, "memory": args.memory, **report})
    if args.record:
        record(args, report)


def record(args, report: dict) -> None:
    count = report["prompts"]
    cells = []
    for exact in report["exact"].values():
        parted = f" (the others part at tokens {', '.join(map(str, exact['part_at']))})" if exact["part_at"] else ""
        cells.append(f"{exact['equal']} of {count}{parted}")
    theirs = ", ".join(str(s["equal"]) for s in report["speed"])
    columns = [
        "compute dtype",
        *(f"{b} at a time: equal to solo" for b in report["exact"]),
        "transformers' `generate_batch` equal to moestream's, per round",
    ]
    caption = (
        f"`--compute-dtype {args.compute_dtype}` ({report['compute_dtype']}): {count} prompts of `--prompts`, {report['tokens']} greedy "
        f"tokens each, decoded several at a time against each alone, `--memory {args.memory}`:"
    )
    table = machine.table(caption, columns, [[report["compute_dtype"], *cells, f"{theirs} of {count}"]])
    path = machine.write_result(args.record, "Batched decoding: exactness", machine.invocation(), [table])
    print(f"wrote {path}")


def joining(model, running_prompts, long_prompt, chunk: int | None) -> tuple[float, float]:
    """(the running sequences' longest time between two tokens while `long_prompt` is prefilled beside
    them, the seconds that prefill took)."""
    batch = BatchGenerator(model, max_batch=3, prefill_chunk=chunk)
    running = [Decoding(model, None, p, SamplingParams.timed(10**6)) for p in running_prompts]
    for d in running:
        batch.admit(d)
        batch.decode()
    for _ in range(3):
        batch.decode()
    newcomer = Decoding(model, None, long_prompt, SamplingParams.timed(4))
    start = last = time.perf_counter()
    batch.admit(newcomer)
    gap = 0.0
    while batch.prefilling is not None:
        batch.prefill_step()
        batch.decode()
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    return gap, last - start


if __name__ == "__main__":
    main()
