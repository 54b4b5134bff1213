"""A copy of a Hugging Face checkpoint whose config allows a longer context (`max_position_embeddings`).

    python benchmarks/widen_context.py SRC DST --positions 32768

For protocol checks that need a long prompt on a small model (an agent CLI's first turn is 12k-20k tokens):
the weights are the same, so the model's text past its trained length is poor, but every request an agent
sends fits, and the server reports the window it was given (/v1/models, /props). Files are linked, not
copied, but for the config.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--positions", type=int, required=True, help="the new max_position_embeddings")
    args = parser.parse_args()
    args.dst.mkdir(parents=True, exist_ok=True)
    for path in args.src.iterdir():
        target = args.dst / path.name
        if target.exists() or target.is_symlink():
            target.unlink()
        if path.name == "config.json":
            config = json.loads(path.read_text())
            config["max_position_embeddings"] = args.positions
            target.write_text(json.dumps(config, indent=2) + "\n")
        elif path.is_file():
            os.symlink(path.resolve(), target)
        else:
            shutil.copytree(path, target)
    print(f"{args.dst}: {args.src.name} with max_position_embeddings {args.positions}")


if __name__ == "__main__":
    main()
