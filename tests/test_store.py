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


def test_experts_files_are_the_same_bytes_written_direct_or_buffered(pristine, tmp_path, monkeypatch):
    """Expert files are written with O_DIRECT where the filesystem takes it and buffered where it refuses it,
    at the open (no O_DIRECT: tmpfs, macOS) or at the first write: the same files either way, byte for byte."""
    import errno
    import fcntl
    import os

    from moestream.conversion import convert as conversion

    src = tmp_path / "hf"
    _, ckpt = tiny_checkpoint("mixtral", src, seed=5)
    opened = []
    real_open = conversion._RecordsFile._open

    def recording_open(self, direct):
        fd, direct = real_open(self, direct)
        opened.append(direct)
        return fd, direct

    monkeypatch.setattr(conversion._RecordsFile, "_open", recording_open)
    stores = {"direct": moestream.convert(ckpt, tmp_path / "direct", progress=False)}
    direct_taken = any(opened)
    if hasattr(os, "O_DIRECT"):
        refused, real_write = [], os.write

        def refusing_write(fd, data):  # an O_DIRECT file's writes refused, as some filesystems do
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", refusing_write)
        stores["refused at the first write"] = moestream.convert(ckpt, tmp_path / "refused", progress=False)
        monkeypatch.setattr(os, "write", real_write)
        assert refused or not direct_taken
        monkeypatch.delattr(os, "O_DIRECT")
    opened.clear()
    stores["no O_DIRECT"] = moestream.convert(ckpt, tmp_path / "buffered", progress=False)
    assert not any(opened)
    reference = Store(pristine).manifest
    for how, store in stores.items():
        assert Store(store).manifest.layers == reference.layers, how
        for layer in reference.layers:
            assert (store / layer.file).read_bytes() == (pristine / layer.file).read_bytes(), how
