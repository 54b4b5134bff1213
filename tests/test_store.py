"""A damaged, truncated, foreign or newer store is refused with an error that names the problem."""

import json
import shutil

import pytest
from tiny import tiny_checkpoint

import moestream
from moestream.conversion.resident_writer import ResidentFileWriter
from moestream.conversion.store import MANIFEST, Store
from moestream.errors import StoreError, UsageError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    _, ckpt = tiny_checkpoint("mixtral", root / "hf", seed=5)
    return moestream.convert(ckpt, root / "store", progress=False)


@pytest.fixture
def store(pristine, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(pristine, copy)
    return copy


def _edit_manifest(store, edit):
    raw = json.loads((store / MANIFEST).read_text())
    edit(raw)
    (store / MANIFEST).write_text(json.dumps(raw))


def test_layout_is_aligned_and_checksummed(pristine):
    manifest = Store(pristine).manifest
    for layer in manifest.layers:
        assert all(off % 4096 == 0 for off in layer.offsets)
        assert layer.layout.stride % 4096 == 0
        data = (pristine / layer.file).read_bytes()
        for off, digest in zip(layer.offsets, layer.checksums):
            assert moestream.conversion.store.checksum(data[off : off + layer.layout.nbytes]) == digest


def test_convert_refuses_to_overwrite(pristine):
    with pytest.raises(UsageError, match="already exists"):
        moestream.convert(pristine, pristine)


def test_corrupt_json(store):
    (store / MANIFEST).write_text("{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        Store(store)


def test_newer_version_says_which_moestream_reads_it(store):
    _edit_manifest(store, lambda m: m.update(format_version=99))
    with pytest.raises(StoreError, match="version 99.*Upgrade moestream"):
        Store(store)


def test_foreign_directory(store):
    _edit_manifest(store, lambda m: m.update(format="something-else"))
    with pytest.raises(StoreError, match="not a moestream store"):
        Store(store)


def test_truncated_expert_file(store):
    layer_file = store / Store(store).manifest.layers[1].file
    data = layer_file.read_bytes()
    layer_file.write_bytes(data[: len(data) - 4096])
    with pytest.raises(StoreError, match="truncated"):
        moestream.load(store, "1MiB")


def test_missing_file(store):
    (store / Store(store).manifest.layers[0].file).unlink()
    with pytest.raises(StoreError, match="missing"):
        Store(store)


def test_path_escaping_the_store(store):
    _edit_manifest(store, lambda m: m["experts"]["layers"][0].update(file="../../etc/passwd"))
    with pytest.raises(StoreError, match="escapes the store directory"):
        Store(store)


def test_unaligned_offset(store):
    _edit_manifest(store, lambda m: m["experts"]["layers"][0]["offsets"].__setitem__(1, 4097))
    with pytest.raises(StoreError, match="not 4096-aligned"):
        Store(store)


def test_interrupted_conversion_leaves_nothing_loadable(tmp_path, monkeypatch):
    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=2)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ResidentFileWriter, "write", boom)  # dies while writing resident weights
    with pytest.raises(KeyboardInterrupt):
        moestream.convert(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    monkeypatch.undo()
    moestream.convert(ckpt, tmp_path / "out", progress=False)
    assert Store(tmp_path / "out").manifest.layers


def test_overwrite_replaces_the_store_and_leaves_nothing_beside_it(pristine, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(pristine, dst)
    (dst / "stale-file").write_text("from the old store")
    src = tmp_path / "hf"
    _, ckpt = tiny_checkpoint("mixtral", src, seed=6)
    moestream.convert(ckpt, dst, overwrite=True, progress=False)
    assert not (dst / "stale-file").exists() and Store(dst).manifest.layers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "store"]
