"""The converter's safetensors writer (conversion/resident_writer.py): tensors declared up front and written
in pieces make a file the safetensors library reads back exactly; pieces out of order, of the wrong dtype or
too many bytes, and a file closed short, are refused; a conversion that fails while writing them leaves nothing."""

import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moestream.conversion.resident_writer import ResidentFileWriter
from moestream.conversion.store import file_checksum
from moestream.errors import SourceError


def test_pieces_make_the_file_the_library_reads(tmp_path):
    g = torch.Generator().manual_seed(4)
    tensors = {
        "embed.weight": torch.randn(37, 24, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 5),
        "head.qweight": torch.randint(-127, 128, (9, 16), generator=g, dtype=torch.int8),
        "head.scales": torch.rand(9, generator=g),
        "norm": torch.randn(24, generator=g, dtype=torch.float64),
        "flags": torch.rand(7, generator=g) > 0.5,
    }
    path = tmp_path / "resident.safetensors"
    writer = ResidentFileWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], metadata={"format": "pt"})
    for name, value in tensors.items():
        for piece in value.split(5) if value.dim() else [value]:  # pieces of 5 rows (the empty one: none)
            writer.write(name, piece)
    checksum = writer.close()
    assert checksum == file_checksum(path) and path.stat().st_size == writer.nbytes
    back = load_file(path)
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_wrong_pieces_and_short_files_are_refused(tmp_path):
    specs = [("a", torch.float32, (4, 2)), ("b", torch.int8, (3,))]
    writer = ResidentFileWriter(tmp_path / "f", specs)
    with pytest.raises(SourceError, match="b written where a comes"):
        writer.write("b", torch.zeros(3, dtype=torch.int8))
    with pytest.raises(SourceError, match="came as torch.float64"):
        writer.write("a", torch.zeros(2, 2, dtype=torch.float64))
    writer.write("a", torch.randn(3, 2))
    with pytest.raises(SourceError, match="more came"):
        writer.write("a", torch.randn(2, 2))
    with pytest.raises(SourceError, match="closed with 24 of its 35"):
        writer.close()


@pytest.mark.parametrize("failing", ["resident", "experts"])
def test_a_failure_on_either_side_of_the_conversion_stops_both_and_leaves_nothing(tmp_path, monkeypatch, failing):
    """The resident files and the expert layers are written by two threads at once: an error on either
    side is the one reported, the other side stops, and no partial store is left behind."""
    from tiny import tiny_checkpoint

    import moestream
    from moestream.conversion import convert as conversion

    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=5)
    name = "_resident_pieces" if failing == "resident" else "_expert_record"
    original = getattr(conversion, name)

    def broken(*args, **kwargs):
        raise SourceError(f"broken {failing} source")

    monkeypatch.setattr(conversion, name, broken)
    with pytest.raises(SourceError, match=f"broken {failing} source"):
        moestream.convert(ckpt, tmp_path / "store", "int8", dense_dtype="int8", progress=False)
    assert not (tmp_path / "store").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".store.partial")]
    assert not [t for t in threading.enumerate() if t.name.startswith("moestream-resident")]
    monkeypatch.setattr(conversion, name, original)  # and the same conversion then succeeds
    assert moestream.convert(ckpt, tmp_path / "store", "int8", dense_dtype="int8", progress=False).is_dir()
