"""A GGUF made by llama.cpp, imported by `moestream convert`, against llama.cpp running the same file.

    python benchmarks/gguf_import.py FILE.gguf STORE --text ../shared/models/tiny-code-moe/heldout.txt [--positions 256] [--json OUT]

STORE is `moestream convert FILE.gguf STORE --experts-dtype fp32 --dense-dtype float` (made first when it
does not exist), so the store holds the GGUF's dequantized weights. The text's first --positions + 1 tokens (the GGUF's own
tokenizer) are fed teacher-forced through both: moestream (`moestream.load`, one forward pass) and llama.cpp
(llama-cpp-python, `logits_all`). Printed per position set: the share of positions whose top-1 token is
the same, the first position where they differ, the mean KL(llama.cpp || moestream) of the next-token
distributions, and each one's perplexity of the text. Both run on this CPU with float32 activations
(llama.cpp quantizes activations to 8 bits for its K-quant dot products, so the two are not bit-equal).
--json writes the same figures; --record writes them as a table of this machine's record of
gguf-vs-llamacpp (benchmarks/machine.py), one table per file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import machine
import numpy as np
import torch


def moestream_logits(store: str, ids: list[int]) -> np.ndarray:
    import moestream

    model, _ = moestream.load(store, memory="1GiB")
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    moestream.close(model)
    return logits.numpy()


def llama_cpp_logits(gguf: str, ids: list[int], threads: int) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=max(512, len(ids) + 8), logits_all=True, n_threads=threads, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("store")
    parser.add_argument("--text", required=True, help="a text file (held-out text of the model)")
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    machine.add_record_argument(parser, "gguf-vs-llamacpp")
    args = parser.parse_args()
    if not Path(args.store).exists():
        command = ["moestream", "convert", args.gguf, args.store, "--experts-dtype", "fp32", "--dense-dtype", "float"]
        subprocess.run([str(Path(sys.executable).with_name("moestream")), *command[1:]], check=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.store)
    ids = tokenizer(Path(args.text).read_text(), add_special_tokens=False)["input_ids"][: args.positions + 1]
    ours = log_softmax(moestream_logits(args.store, ids)[:-1])
    theirs = log_softmax(llama_cpp_logits(args.gguf, ids, args.threads)[:-1])
    targets = np.array(ids[1:])
    same = ours.argmax(-1) == theirs.argmax(-1)
    first = int(np.argmin(same)) if not same.all() else None
    kl = (np.exp(theirs) * (theirs - ours)).sum(-1).mean()
    ppl = [float(np.exp(-lp[np.arange(len(targets)), targets].mean())) for lp in (ours, theirs)]
    print(f"machine: {machine.line()}")
    print(f"{Path(args.gguf).name}: {len(targets)} positions")
    print(f"top-1 identical {same.mean():.1%}, first divergence at {first}, mean KL {kl:.2e}")
    print(f"perplexity moestream {ppl[0]:.4f}, llama.cpp {ppl[1]:.4f}")
    if args.json:
        figures = dict(positions=len(targets), top1_identical=float(same.mean()), first_divergence=first, mean_kl=float(kl))
        machine.write_json(
            args.json, {"gguf": Path(args.gguf).name, **figures, "perplexity": dict(zip(("moestream", "llama.cpp"), ppl))}
        )
    if args.record:
        name = Path(args.gguf).name
        columns = [
            "file",
            f"top-1 identical ({len(targets)} positions)",
            "first divergence",
            "mean KL(llama.cpp, moestream)",
            "perplexity moestream",
            "llama.cpp",
        ]
        row = [name, f"{same.mean():.1%}", "none" if first is None else first, f"{kl:.1e}", f"{ppl[0]:.2f}", f"{ppl[1]:.2f}"]
        caption = f"`{name}` imported into `{Path(args.store).name}` and run by both engines, the text's first {len(targets) + 1} tokens teacher forced:"
        title = "GGUF files imported, against llama.cpp on the same file"
        path = machine.write_result(args.record, title, machine.invocation(), [machine.table(caption, columns, [row])])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
