"""A deeper GGUF made from a GGUF's own layers, repeated: a large file of a real model's shapes and block
types for timing an import where its fixed costs (imports, header, tokenizer) no longer count.

    python benchmarks/gguf_more_layers.py IN.gguf OUT.gguf --times 3

OUT has `--times` times IN's layers: layer i + k * n (n layers in IN) is a copy of layer i's tensors, and the
block count says so; the embedding, output and metadata are IN's. The weights are not a model anyone
trained (the copies route as their originals); the file is for speed, not quality. Written with gguf-py
(llama.cpp's own reader and writer), tensor by tensor from IN's memory map.
"""

from __future__ import annotations

import argparse
import re

import gguf
from tqdm import tqdm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--times", type=int, default=3, help="how many times each layer appears in OUT")
    args = parser.parse_args()
    reader = gguf.GGUFReader(args.src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    layers = int(reader.fields[count_key].contents())
    writer = gguf.GGUFWriter(args.dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = layers * args.times if field.name == count_key else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    # (name in OUT, tensor of IN): the layers in order, each copy k of the file's n layers after copy k - 1
    order = []
    per_layer = [[] for _ in range(layers)]
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m is None:
            order.append((t.name, t))
        else:
            per_layer[int(m[1])].append((m[2], t))
    for k in range(args.times):
        for i, tensors in enumerate(per_layer):
            order.extend((f"blk.{i + k * layers}.{rest}", t) for rest, t in tensors)
    for name, t in order:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in tqdm(order, desc="writing", unit="tensor"):
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


if __name__ == "__main__":
    main()
