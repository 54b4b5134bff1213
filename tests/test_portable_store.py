"""One store for every machine: a store converted under one CPU capability runs under another with the same
tokens, and a version 3 store (int4 bytes in torch's kernel layout of the converting CPU) still runs where
its layout matches, is refused with the upgrade command elsewhere, and `moestream upgrade` makes it the
version 4 store, byte for byte.

`ATEN_CPU_CAPABILITY` makes torch dispatch its kernels as another CPU would (read at start-up, so each run
is a subprocess): "default" is torch's portable build, whose int4 layout differs from AVX2's and AVX512's."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny import TINY

import moestream
from moestream.conversion.quant import LEGACY_PACKINGS, compress_int4_bytes, legacy_nibble_index, stored_codes, torch_int4_packing
from moestream.conversion.store import DTYPES, MANIFEST, Store, checksum, file_checksum
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.conversion.upgrade import upgrade
from moestream.errors import StoreError

# Widths the vectorized repack takes (inputs a multiple of 64), and a tail of 16 rows in k_proj (2 x 24 = 32 + 16).
CONFIG = dict(TINY["qwen3_moe"], hidden_size=128, moe_intermediate_size=64, head_dim=24, num_experts=8)
NATIVE = torch_int4_packing()
CAPABILITIES = ["default", "avx2"] + (["avx512"] if "avx512" in NATIVE else [])

_RUN = """
import json, sys, torch, moestream
from moestream.conversion.quant import torch_int4_packing
store, ids = sys.argv[1], json.loads(sys.argv[2])
model, _ = moestream.load(store, "1MiB", compute_dtype="fp32")
prompt = torch.tensor([ids])
with torch.no_grad():
    logits = model(prompt).logits[0, -1]
    tokens = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(ids):]
print(json.dumps({"packing": torch_int4_packing(), "logits": logits.tolist(), "tokens": tokens.tolist()}))
"""


def _python(capability: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def _run_under(capability: str, store, ids) -> dict:
    done = _python(capability, "-c", _RUN, str(store), json.dumps(ids))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(make_model("qwen3_moe", seed=21, **CONFIG), tmp_path_factory.mktemp("portable") / "hf")


def _ids(seed: int) -> list[int]:
    return torch.randint(0, CONFIG["vocab_size"] - 2, (9,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_store_converted_under_one_cpu_capability_runs_the_same_under_another(checkpoint, tmp_path):
    """Converted here (this CPU's capability); run here and under every other capability torch can take on
    this CPU (each a subprocess): the same greedy tokens, logits within the kernels' own rounding."""
    store = moestream.convert(checkpoint, tmp_path / "store", "int4", layer_dtypes=["1=int3"], dense_dtype="int4", progress=False)
    ids = _ids(3)
    model, _ = moestream.load(store, "1MiB", compute_dtype="fp32")
    prompt = torch.tensor([ids])
    with torch.no_grad():
        here = {
            "packing": NATIVE,
            "logits": model(prompt).logits[0, -1],
            "tokens": model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(ids) :].tolist(),
        }
    others = [_run_under(c, store, ids) for c in CAPABILITIES if f"torch-cpu-{c}" != NATIVE]
    assert others and {run["packing"] for run in others} == {f"torch-cpu-{c}" for c in CAPABILITIES} - {NATIVE}  # each ran so
    for other in others:
        assert other["tokens"] == here["tokens"]
        a, b = here["logits"], torch.tensor(other["logits"])
        # Each capability's int4 kernel rounds its bf16 activations and sums in its own order.
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()


def _as_version_3(store, packing: str) -> None:
    """Rewrite a version 4 store as the version 3 store a machine with `packing` would have written: every
    int4-family matrix in torch's kernel layout (int3/int2 compressed from it), new checksums."""
    manifest = json.loads((store / MANIFEST).read_text())
    opened = Store(store).manifest

    def legacy(qweight: torch.Tensor, fmt) -> torch.Tensor:
        codes = stored_codes(qweight, fmt)
        n, k = codes.shape
        nibbles = torch.empty(n * k, dtype=torch.uint8)
        nibbles[legacy_nibble_index(packing, n, k).reshape(-1)] = codes.reshape(-1)
        kernel = nibbles[0::2] | (nibbles[1::2] << 4)
        return (kernel if fmt.bits == 4 else compress_int4_bytes(kernel.view(n, -1), fmt.bits)).view(qweight.shape)

    for raw, layer in zip(manifest["experts"]["layers"], opened.layers):
        if layer.quantization is None or layer.quantization.name == "int8":
            continue
        raw["quantization"]["packing"] = packing
        path = store / layer.file
        data = np.fromfile(path, dtype=np.uint8)
        for e, offset in enumerate(layer.offsets):
            record = torch.from_numpy(data[offset : offset + layer.layout.stride])
            for t in layer.layout.tensors:
                if t.name.endswith(".qweight"):
                    view = record[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
                    view.copy_(legacy(view.clone(), layer.quantization))
            raw["checksums"][e] = checksum(data[offset : offset + layer.layout.nbytes])
        data.tofile(path)
    from safetensors.torch import load_file, save_file

    for raw in manifest["resident"]["files"]:
        tensors = load_file(store / raw["path"])
        for name, fmt in opened.dense.items():
            if fmt.name == "int4" and f"{name}.qweight" in tensors:
                tensors[f"{name}.qweight"] = legacy(tensors[f"{name}.qweight"], fmt)
                manifest["dense_quantization"][name]["packing"] = packing
        save_file(tensors, str(store / raw["path"]), metadata={"format": "pt"})
        raw["size"], raw["checksum"] = (store / raw["path"]).stat().st_size, file_checksum(store / raw["path"])
    manifest["format_version"] = 3
    (store / MANIFEST).write_text(json.dumps(manifest))


def test_a_version_3_store_runs_where_its_layout_matches_and_upgrades_to_the_portable_store(checkpoint, tmp_path):
    portable = moestream.convert(checkpoint, tmp_path / "v4", "int4", layer_dtypes=["1=int2"], dense_dtype="int4", progress=False)
    old = moestream.convert(checkpoint, tmp_path / "v3", "int4", layer_dtypes=["1=int2"], dense_dtype="int4", progress=False)
    other = next(p for p in LEGACY_PACKINGS if p != NATIVE)
    _as_version_3(old, NATIVE)
    ids = _ids(5)
    with torch.no_grad():
        expected, _ = moestream.load(portable, "1MiB", compute_dtype="fp32")
        as_was, _ = moestream.load(old, "1MiB", compute_dtype="fp32")  # its bytes are this machine's layout
        prompt = torch.tensor([ids])
        assert torch.equal(expected(prompt).logits, as_was(prompt).logits)  # the same kernel bytes, so the same bits

    # Where the layout differs, the store is refused with the command that fixes it.
    (old / MANIFEST).write_text((old / MANIFEST).read_text().replace(NATIVE, other))
    with pytest.raises(StoreError, match=f"torch's {other} layout.*moestream upgrade STORE"):
        moestream.load(old, "1MiB")
    (old / MANIFEST).write_text((old / MANIFEST).read_text().replace(other, NATIVE))

    done = _python("default", "-m", "moestream.cli", "upgrade", str(old))  # needs neither the checkpoint nor that CPU
    assert done.returncode == 0 and "upgraded" in done.stdout, done.stderr[-3000:]
    upgraded, original = Store(old).manifest, Store(portable).manifest
    assert upgraded.format_version == 4
    assert [layer.checksums for layer in upgraded.layers] == [layer.checksums for layer in original.layers]  # byte for byte
    assert [f.checksum for f in upgraded.resident_files] == [f.checksum for f in original.resident_files]
    assert upgraded.dense == original.dense and [layer.quantization for layer in upgraded.layers] == [
        layer.quantization for layer in original.layers
    ]
    assert upgrade(old, progress=False) is False  # nothing in it depends on a machine any more
