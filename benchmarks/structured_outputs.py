"""What a grammar costs per token: the constrained-decoding libraries side by side, and decode with a JSON
schema against without.

    python benchmarks/structured_outputs.py libraries TOKENIZER_DIR [--train-vocab N] [--json OUT]
    python benchmarks/structured_outputs.py decode STORE [--memory 1GiB] [--tokens 64] [--rounds 3] [--json OUT]

`libraries`: per token (mean, median, p90, max of the best of --rounds fresh runs, by mean), the time to compute the mask of allowed tokens and apply it to a row of logits,
while a valid JSON document of a schema (enums, a bounded integer, strings, an array) is fed token by
token, for llguidance (what moestream uses), xgrammar and outlines-core (each where installed), plus each
one's compile time for the schema. `--train-vocab N` first trains a byte-level BPE tokenizer of N tokens on
this Python's own source files into TOKENIZER_DIR (a stand-in for a 150k-token vocabulary such as Qwen3's,
which cannot be downloaded here); the mask's cost grows with the vocabulary.

`decode`: greedy decode tok/s (prefill excluded) of `moestream.load(STORE)` with the schema's grammar in
the sampler against without, alternating, in one process; --tokens per run either way (a grammar that
completes early is started again with a new answer, whose prefill is not counted).

Prints a table; --json writes it with the machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import sysconfig
import time

import machine
import numpy as np
import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"], "ok": True}


def train_tokenizer(directory: str, size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)
    files += glob.glob(sysconfig.get_paths()["purelib"] + "/**/*.py", recursive=True)

    def texts():
        for path in files:
            try:
                yield open(path, encoding="utf-8").read()
            except (OSError, UnicodeDecodeError):
                continue

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(directory)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, width: int) -> None:
    allowed = torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:width].astype(bool))
    logits.masked_fill_(~allowed, float("-inf"))


def time_llguidance(tokenizer, ids: list[int], width: int) -> tuple[float, list[float]]:
    from moestream.generation.constraints import Constraint, Grammar, Vocabulary

    vocabulary = Vocabulary(tokenizer, width, (tokenizer.eos_token_id,))
    start = time.perf_counter()
    constraint = Constraint(Grammar.json_schema(SCHEMA), vocabulary)
    compile_s = time.perf_counter() - start
    logits, per = torch.randn(1, width), []
    for t in ids:
        row = logits.clone()
        start = time.perf_counter()
        constraint.mask(row)
        per.append(time.perf_counter() - start)
        assert row[0, t] > float("-inf"), "llguidance refused a token of the valid document"
        constraint.advance(t)
    return compile_s, per


def time_xgrammar(tokenizer, ids: list[int], width: int) -> tuple[float, list[float]]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=width))
    start = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, width)
    logits, per = torch.randn(1, width), []
    for t in ids:
        row = logits.clone()
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(row, bitmask)
        per.append(time.perf_counter() - start)
        assert row[0, t] > float("-inf"), "xgrammar refused a token of the valid document"
        matcher.accept_token(t)
    return compile_s, per


def time_outlines(tokenizer, ids: list[int], width: int) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {v: k for k, v in bytes_to_unicode().items()}  # byte-level BPE's printable stand-ins
    words: dict[bytes, list[int]] = {}
    for i in range(len(tokenizer)):
        if i != tokenizer.eos_token_id:
            words.setdefault(bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(i)), []).append(i)
    vocabulary = Vocabulary(tokenizer.eos_token_id, words)
    start = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="[ ]?")
    guide = Guide(Index(regex, vocabulary))
    compile_s = time.perf_counter() - start
    logits, per = torch.randn(1, width), []
    for t in ids:
        row = logits.clone()
        start = time.perf_counter()
        allowed = torch.zeros(width, dtype=torch.bool)
        allowed[torch.tensor(guide.get_tokens())] = True
        row.masked_fill_(~allowed, float("-inf"))
        per.append(time.perf_counter() - start)
        assert row[0, t] > float("-inf"), "outlines-core refused a token of the valid document"
        guide.advance(t)
    return compile_s, per


def libraries(args) -> None:
    from transformers import AutoTokenizer

    if args.train_vocab:
        train_tokenizer(args.tokenizer, args.train_vocab)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    width = len(tokenizer)
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    print(f"machine: {machine.line()}")
    print(f"vocabulary {width} tokens; document {len(ids)} tokens")
    results = {}
    print(f"{'library':<14} {'compile ms':>10} {'mean us/token':>14} {'median':>7} {'p90':>7} {'max':>7}")
    for name, run in (("llguidance", time_llguidance), ("xgrammar", time_xgrammar), ("outlines-core", time_outlines)):
        try:
            best = None
            for _ in range(args.rounds):
                compile_s, per = run(tokenizer, ids, width)
                mean = statistics.fmean(per)
                if best is None or mean < best[1]:
                    best = (compile_s, mean, statistics.median(per), sorted(per)[int(0.9 * len(per))], max(per))
        except ImportError as e:
            print(f"{name:<14} not installed ({e.name})")
            continue
        print(f"{name:<14} {best[0] * 1e3:>10.1f} " + " ".join(f"{v * 1e6:>{w}.0f}" for v, w in zip(best[1:], (14, 7, 7, 7))))
        results[name] = dict(zip(("compile_s", "mean_s", "median_s", "p90_s", "max_s"), best))
    if args.json:
        machine.write_json(args.json, {"vocabulary": width, "document_tokens": len(ids), "libraries": results})
    if args.record:
        rows = [
            [
                f"{width:,}" if i == 0 else "",
                name,
                f"{r['compile_s'] * 1e3:.1f}",
                *(f"{r[k] * 1e6:,.0f}" for k in ("mean_s", "median_s", "p90_s", "max_s")),
            ]
            for i, (name, r) in enumerate(results.items())
        ]
        caption = (
            f"Per token of a valid JSON document of a schema ({len(ids)} tokens), the time to compute the mask of allowed tokens and apply it "
            f"to a row of logits, best of {args.rounds} runs by mean, and the schema's compile time; a {width:,}-token vocabulary:"
        )
        columns = ["vocabulary", "library", "compile ms", "mean us/token", "median", "p90", "max"]
        write_record(args, [machine.table(caption, columns, rows)], "")


def decode(args) -> None:
    import moestream
    from moestream.generation.constraints import Grammar
    from moestream.generation.generate import SamplingParams
    from moestream.generation.serving import stream

    model, tokenizer = moestream.load(args.store, memory=args.memory)
    prompt = tokenizer("Here is the record as JSON:", add_special_tokens=False)["input_ids"]
    grammar = Grammar.json_schema(SCHEMA)

    def run(constrained: bool) -> float:
        """Decode tok/s (Timing's definition: tokens after the first over their seconds), summed over as
        many answers as it takes to make --tokens (a grammar that completes ends its answer early)."""
        made, decoded, seconds = 0, 0, 0.0
        while made < args.tokens:
            params = SamplingParams.greedy(args.tokens - made, grammar=grammar if constrained else None)
            result = stream(model, tokenizer, prompt, params)
            made += len(result.token_ids)
            decoded += len(result.token_ids) - 1
            seconds += result.timing.decode_seconds
        return decoded / seconds

    run(False), run(True)  # warm-up: every expert read, the kernels built
    plain, schema = [], []
    for _ in range(args.rounds):
        plain.append(run(False))
        schema.append(run(True))
    print(f"machine: {machine.line()}")
    print(f"{args.tokens} tokens per run, decode tok/s (prefill excluded)")
    for i, (p, s) in enumerate(zip(plain, schema)):
        print(f"round {i + 1}: without {p:.2f} tok/s, with the schema {s:.2f} tok/s: {s / p:.3f}x")
    median = statistics.median(s / p for p, s in zip(plain, schema))
    print(f"median ratio {median:.3f}x")
    if args.json:
        rates = {"without": plain, "with_schema": schema, "median_ratio": median}
        machine.write_json(args.json, {"store": args.store, "tokens": args.tokens, "decode_tokens_per_second": rates})
    if args.record:
        rows = [[i + 1, f"{p:.2f}", f"{s:.2f}", f"{s / p:.3f}x"] for i, (p, s) in enumerate(zip(plain, schema))]
        caption = (
            f"Decode with the schema against without, greedy, {args.tokens} tokens per run, prefill excluded, alternating in one "
            f"process, `--memory {args.memory}`:"
        )
        table = machine.table(caption, ["round", "without tok/s", "with the schema tok/s", "ratio"], rows)
        write_record(args, [table], f"Decode: median ratio **{median:.3f}x**.")


def write_record(args, tables: list[dict], notes: str) -> None:
    path = machine.write_result(args.record, "Structured outputs: what a grammar costs", machine.invocation(), tables, notes)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    lib = sub.add_parser("libraries", help="mask cost per token of llguidance, xgrammar and outlines-core")
    lib.add_argument("tokenizer", help="a directory with a Hugging Face fast tokenizer (written first with --train-vocab)")
    lib.add_argument("--train-vocab", type=int, default=0, help="train a byte-level BPE of this many tokens into the directory")
    lib.add_argument("--rounds", type=int, default=3)
    lib.add_argument("--json", help="write the table here too")
    machine.add_record_argument(lib, "structured-outputs")
    dec = sub.add_parser("decode", help="decode tok/s with the schema's grammar against without")
    dec.add_argument("store")
    dec.add_argument("--memory", default="1GiB")
    dec.add_argument("--tokens", type=int, default=64)
    dec.add_argument("--rounds", type=int, default=3)
    dec.add_argument("--json", help="write the rounds here too")
    machine.add_record_argument(dec, "structured-outputs")
    args = parser.parse_args()
    libraries(args) if args.what == "libraries" else decode(args)


if __name__ == "__main__":
    sys.exit(main())
