"""The command line: help lists every command, inspect and generate work on a converted store."""

import json
import subprocess
import sys

import pytest
from tiny import tiny_checkpoint

from moestream.cli import main


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=3)
    assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return root / "store"


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "moestream.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("convert", "generate", "inspect", "verify", "eval", "demo"):
        assert command in out


def test_inspect_prints_sizes(store, capsys):
    assert main(["inspect", str(store), "--memory", "64KiB"]) == 0
    out = capsys.readouterr().out
    assert "worst-case read per token" in out and "caches 8 experts" in out


def test_generate_json_is_greedy_and_deterministic(store, capsys):
    args = ["generate", str(store), "--memory", "40KiB", "--prompt", "def f(x):", "--max-new-tokens", "12", "--greedy", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args[:3] + ["1MiB"] + args[4:]) == 0
    second = json.loads(capsys.readouterr().out)
    assert len(first["token_ids"]) == 12 and first["token_ids"] == second["token_ids"]
    assert first["stats"]["misses"] > 0 and 0.0 <= first["stats"]["hit_rate"] <= 1.0
    assert first["stats"]["bytes_read"] > second["stats"]["bytes_read"] > 0


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error:") and "manifest.json" in err
    assert main(["inspect", str(tmp_path), "--memory", "lots"]) == 2


def test_layer_dtype_counts_from_the_end_as_written(tmp_path):
    from moestream.store import Store

    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=4)
    # "-1=int8" as its own argument: argparse alone would take it for an unknown option.
    assert main(["convert", str(ckpt), str(tmp_path / "store"), "--experts-dtype", "fp32", "--layer-dtype", "-1=int8"]) == 0
    layers = Store(tmp_path / "store").manifest.layers
    assert [layer.quantization.name if layer.quantization else None for layer in layers] == [None, "int8"]
