"""Convert a Hugging Face checkpoint to GGUF with llama.cpp's own converter, for `bench --compare-gguf`.

    pip download llama-cpp-python --no-deps --no-binary :all: && tar xzf llama_cpp_python-*.tar.gz
    python benchmarks/to_gguf.py --llama-cpp llama_cpp_python-*/vendor/llama.cpp CHECKPOINT --outtype bf16 --outfile model.gguf

Two concessions, both about the tokenizer, which the benchmark does not use (it feeds token ids): a BPE
pre-tokenizer the converter does not recognise is treated as the default one, and a vocabulary without
merges (the synthetic byte-level one) gets a placeholder merge, since llama.cpp's BPE loader refuses none.
The weights are converted unchanged.
"""

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree (has convert_hf_to_gguf.py)")
    args, rest = parser.parse_known_args()
    root = Path(args.llama_cpp).resolve()
    sys.path[:0] = [str(root / "gguf-py"), str(root)]

    import conversion.base as base
    import gguf

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def add_with_a_merge(self, writer, quiet=False):
        if not self.merges:
            self.merges = ["a b"]
        return add_to_gguf(self, writer, quiet)

    gguf.SpecialVocab.add_to_gguf = add_with_a_merge
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
