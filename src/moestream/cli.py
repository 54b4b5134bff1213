"""The `moestream` command: one subcommand per verb, each defined by its own module in commands/.

A verb module defines `DESCRIPTION` (optional), `add_arguments(parser)` and `run(args) -> int` (the exit
code). This file lists the verbs with their one-line help, builds the parsers from those modules and turns
moestream's own errors into one line. Only the verb being run is imported. Options several verbs share are
in options.py. Verb modules import torch, transformers, the engine and optional extras (FastAPI,
matplotlib) inside `run`, so that every `--help` answers at once, without them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from .errors import MoestreamError
from .options import apply_threads
from .version import __version__

#: verb -> (module of this package that defines it, its line in `moestream --help`), in the order listed.
#: The line lives here, not in the module, so that `moestream --help` imports no verb module and
#: `moestream VERB` imports only that verb's module.
VERBS = {
    "convert": ("commands.convert", "convert a Hugging Face MoE checkpoint directory into a store"),
    "inspect": ("commands.inspect", "sizes of a store and what a memory budget buys"),
    "verify": ("commands.verify", "check a store's files and every record's checksum; exit 1 listing what is damaged"),
    "upgrade": (
        "commands.upgrade",
        "rewrite a store from an earlier moestream in the current format, so it runs on any machine",
    ),
    "generate": ("commands.generate", "generate text, streaming experts under a memory budget"),
    "chat": ("commands.chat", "talk with a store in the terminal, through the checkpoint's chat template"),
    "serve": ("commands.serve", "serve a store over an OpenAI-compatible HTTP API (needs `pip install 'moestream[server]'`)"),
    "eval": ("commands.eval", "how far a store's next-token predictions are from a reference's: perplexity, KL, top-1 agreement"),
    "bench": ("commands.bench", "decode speed against the disk's limit, measured in one run (optionally against peers)"),
    "trace": ("commands.trace", "record which experts a text routes to, per token and layer, into a trace file"),
    "simulate": ("commands.simulate", "replay a trace through the cache policies at several budgets, next to the optimum"),
    "plan": ("commands.plan", "sizes, cache and expected speed of a model from its config.json alone, before downloading it"),
    "demo": ("commands.demo", "build a synthetic MoE, convert it and stream it under a sweep of budgets"),
}

EPILOG = """examples:
  moestream demo
  moestream convert ./Qwen3-30B-A3B ./qwen3-30b.moe
  moestream convert ./Qwen3-30B-A3B ./qwen3-30b-int4.moe --experts-dtype int4
  moestream inspect ./qwen3-30b.moe --memory 4GiB
  moestream verify ./qwen3-30b.moe
  moestream upgrade ./qwen3-30b-int4.moe
  moestream generate ./qwen3-30b.moe --memory 4GiB --prompt "def fibonacci(n):" --max-new-tokens 64
  moestream chat ./qwen3-30b.moe --memory 4GiB
  moestream serve ./qwen3-30b.moe --memory 4GiB --port 8000
  moestream eval ./qwen3-30b.moe --reference ./Qwen3-30B-A3B --text heldout.txt

--memory is the byte budget of the expert cache; the resident weights (embeddings, attention, routers,
norms, shared experts, LM head) come on top of it. `moestream inspect` prints both.
"""


def verb_module(verb: str) -> ModuleType:
    """The module that defines `verb` (DESCRIPTION, add_arguments, run)."""
    return importlib.import_module(f"{__package__}.{VERBS[verb][0]}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `moestream` parser. With `only`, just that verb's module is imported and given its arguments:
    the other verbs are listed (for `moestream --help` and argparse's errors) without their options."""
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts models larger than memory: dense weights stay resident, "
        "experts stream from SSD through a byte-budgeted cache.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb, (_, help) in VERBS.items():
        if only is not None and verb != only:
            sub.add_parser(verb, help=help)
            continue
        module = verb_module(verb)
        p = sub.add_parser(verb, help=help, description=getattr(module, "DESCRIPTION", None) or help)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def _verb_in(argv: list[str]) -> str | None:
    """The verb `argv` runs: its first argument that is not an option, if that names a verb."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in VERBS else None


def _attach_negative_layer_rules(argv: list[str]) -> list[str]:
    """`--layer-dtype -1=int4` -> `--layer-dtype=-1=int4`: argparse takes a value that starts with "-"
    and is not a plain number for an option of its own, and counting from the last layer is the point."""
    out = []
    for arg in argv:
        if out and out[-1] == "--layer-dtype" and arg.startswith("-"):
            out[-1] = f"--layer-dtype={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _attach_negative_layer_rules(sys.argv[1:] if argv is None else argv)
    verb = _verb_in(argv)
    # No verb (`moestream --help`, `--version`, a typo): list the verbs without importing any of them.
    args = build_parser(only=verb or "").parse_args(argv)
    try:
        apply_threads(args)
        return args.func(args)
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmoestream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
