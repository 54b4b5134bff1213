"""The `moestream` command: one subcommand per verb, each defined by its own module.

A verb module defines `HELP` (its line in `moestream --help`), optionally `DESCRIPTION`,
`add_arguments(parser)` and `run(args) -> int` (the exit code). This file only lists the verbs, builds
the parsers from those modules and turns moestream's own errors into one line. Options several verbs
share are in options.py. Verb modules import optional extras (FastAPI, matplotlib) inside `run`, so
that every `--help` works without them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from . import __version__
from .errors import MoestreamError

#: verb -> module of this package that defines it, in the order `moestream --help` lists them.
VERBS = {
    "convert": "conversion.convert",
    "inspect": "conversion.inspect_store",
    "verify": "conversion.verify",
    "generate": "frontends.generate",
    "chat": "frontends.chat",
    "serve": "frontends.server",
    "eval": "tools.quality",
    "bench": "tools.bench",
    "trace": "tools.trace",
    "simulate": "tools.simulate",
    "plan": "tools.plan",
    "demo": "tools.demo",
}

EPILOG = """examples:
  moestream demo
  moestream convert ./Qwen3-30B-A3B ./qwen3-30b.moe
  moestream convert ./Qwen3-30B-A3B ./qwen3-30b-int4.moe --experts-dtype int4
  moestream inspect ./qwen3-30b.moe --memory 4GiB
  moestream verify ./qwen3-30b.moe
  moestream generate ./qwen3-30b.moe --memory 4GiB --prompt "def fibonacci(n):" --max-new-tokens 64
  moestream chat ./qwen3-30b.moe --memory 4GiB
  moestream serve ./qwen3-30b.moe --memory 4GiB --port 8000
  moestream eval ./qwen3-30b.moe --reference ./Qwen3-30B-A3B --text heldout.txt

--memory is the byte budget of the expert cache; the resident weights (embeddings, attention, routers,
norms, shared experts, LM head) come on top of it. `moestream inspect` prints both.
"""


def verb_module(verb: str) -> ModuleType:
    """The module that defines `verb` (HELP, DESCRIPTION, add_arguments, run)."""
    return importlib.import_module(f"{__package__}.{VERBS[verb]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts models larger than memory: dense weights stay resident, "
        "experts stream from SSD through a byte-budgeted cache.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb in VERBS:
        module = verb_module(verb)
        p = sub.add_parser(verb, help=module.HELP, description=getattr(module, "DESCRIPTION", None) or module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


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
    args = build_parser().parse_args(_attach_negative_layer_rules(sys.argv[1:] if argv is None else argv))
    try:
        return args.func(args)
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmoestream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
