"""`moestream generate`: its options and what it runs. The generation itself is generation/generate.py's; a
routing trace of the run (--trace-out) is tools/trace.py's, so this module, not generate.py, is where the two
meet (generate.py stays free of the tools that use it)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..errors import UsageError
from ..options import add_sampling_arguments, add_store_arguments, load_model, sampling_params, trace_output

DESCRIPTION = (
    "Generate a continuation of --prompt, streaming the text as it comes, then print tokens/s, time to first "
    "token, expert hit rate, MB read from disk and peak RSS (or, with --json, one JSON object with all of them)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--prompt", required=True, help="prompt text")
    add_sampling_arguments(parser, max_new_tokens=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats) instead of streaming")
    parser.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE.json",
        help="make the answer JSON that validates against this JSON Schema (the sampler only draws tokens the schema allows)",
    )
    parser.add_argument(
        "--trace-out",
        default=None,
        metavar="FILE.npz",
        help="record this run's routing (expert ids and weights per token and layer) for `moestream simulate`",
    )


def run(args: argparse.Namespace) -> int:
    from ..generation.constraints import GrammarError
    from ..generation.generate import encode, vocabulary_of
    from ..generation.serving import generate
    from ..tools.trace import start_recording, stop_recording

    if not args.prompt:
        raise UsageError("--prompt is empty; generation needs some text to continue, e.g. --prompt 'Once upon a time'")
    params = sampling_params(args)
    if args.trace_out:
        trace_output(args.trace_out, "--trace-out")
    grammar = _schema_grammar(args.json_schema) if args.json_schema else None
    model, tokenizer = load_model(args)
    if not encode(tokenizer, args.prompt):
        raise UsageError(f"--prompt {args.prompt!r} has no tokens for this tokenizer; pass some text")
    if grammar is not None:
        try:
            vocabulary_of(model, tokenizer).check(grammar)
        except GrammarError as e:
            raise UsageError(f"--json-schema {args.json_schema}: {e}") from None
    recorder = start_recording(model) if args.trace_out else None  # routing recorded through the engine
    result = generate(model, tokenizer, args.prompt, replace(params, grammar=grammar), echo=not args.json)
    if args.json:
        out = {
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_tokens": result.prompt_tokens,
            "seconds": result.seconds,
            "time_to_first_token": result.time_to_first_token,
            "decode_tokens_per_second": result.decode_tokens_per_second,
            "stats": result.stats,
        }
        print(json.dumps(out))
    else:
        print(result.summary(), file=sys.stderr)
    if recorder is not None:
        stop_recording(model)
        print(f"wrote {recorder.trace(prompt=args.prompt).save(args.trace_out)}", file=sys.stderr)
    return 0


def _schema_grammar(path: str):
    from ..generation.constraints import Grammar, GrammarError

    try:
        schema = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise UsageError(f"--json-schema {path}: cannot read it ({e.strerror}); pass a JSON Schema file") from None
    except ValueError as e:
        raise UsageError(f"--json-schema {path}: not valid JSON ({e}); pass a JSON Schema file") from None
    try:
        return Grammar.json_schema(schema)
    except GrammarError as e:
        raise UsageError(f"--json-schema {path}: {e}") from None
