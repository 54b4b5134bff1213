"""No file moestream reads can make it run code: no pickles, no custom modeling or tokenizer code unasked."""

import json
import pickle
import shutil

import pytest
from tiny import tiny_checkpoint

import moestream
from moestream.errors import SourceError, StoreError


class _Payload:
    """Unpickling this writes a marker file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("safety") / "hf", seed=4)
    return ckpt


def test_a_pickled_checkpoint_is_refused_without_unpickling(checkpoint, tmp_path):
    src = tmp_path / "pickled"
    shutil.copytree(checkpoint, src)
    for f in src.glob("*.safetensors"):
        f.unlink()
    marker = tmp_path / "unpickled"
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(SourceError, match=r"no \*\.safetensors files.*save_pretrained"):
        moestream.convert(src, tmp_path / "out", progress=False)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_custom_modeling_code_needs_trust_remote_code(checkpoint, tmp_path):
    src = tmp_path / "custom"
    shutil.copytree(checkpoint, src)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    (src / "modeling_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(SourceError, match="custom modeling code.*--trust-remote-code"):
        moestream.convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_a_damaged_source_config_is_a_clear_error(checkpoint, tmp_path):
    src = tmp_path / "damaged"
    shutil.copytree(checkpoint, src)
    (src / "config.json").write_text('{"model_type": "qwen3_moe", ')
    with pytest.raises(SourceError, match="config.json is not valid JSON"):
        moestream.convert(src, tmp_path / "out", progress=False)


def test_a_store_never_runs_tokenizer_code(checkpoint, tmp_path):
    store = moestream.convert(checkpoint, tmp_path / "store", progress=False)
    settings = json.loads((store / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    settings["tokenizer_class"] = "EvilTokenizer"
    (store / "tokenizer_config.json").write_text(json.dumps(settings))
    (store / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(StoreError, match="never runs code from a store"):
        moestream.load(store, "1MiB")
    assert not (tmp_path / "ran").exists()


def test_a_store_config_that_transformers_rejects_is_a_store_error(checkpoint, tmp_path):
    store = moestream.convert(checkpoint, tmp_path / "store", progress=False)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["model_config"]["num_experts_per_tok"] = "two"
    manifest["model_config"]["layer_types"] = 7
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError):
        moestream.load(store, "1MiB")
