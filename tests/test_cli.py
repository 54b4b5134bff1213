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
    from moestream.cli import VERBS

    for command in VERBS:
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


def test_threads_sets_the_compute_threads_the_run_uses(store, capsys, monkeypatch):
    import torch

    import moestream.generation.serving as serving

    seen = []
    original = serving.stream

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(serving, "stream", spy)
    before = torch.get_num_threads()
    try:
        args = ["generate", str(store), "--prompt", "def f(x):", "--max-new-tokens", "3", "--greedy", "--json"]
        assert main([*args, "--threads", "1"]) == 0
        assert seen and set(seen) == {1}
        seen.clear()
        assert main(args) == 0  # the default: this process's physical cores
        from moestream.options import physical_cores

        assert set(seen) == {physical_cores()}
    finally:
        torch.set_num_threads(before)


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error:") and "manifest.json" in err
    assert main(["inspect", str(tmp_path), "--memory", "lots"]) == 2


def test_layer_dtype_counts_from_the_end_as_written(tmp_path):
    from moestream.conversion.store import Store

    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=4)
    # "-1=int8" as its own argument: argparse alone would take it for an unknown option.
    assert main(["convert", str(ckpt), str(tmp_path / "store"), "--experts-dtype", "fp32", "--layer-dtype", "-1=int8"]) == 0
    layers = Store(tmp_path / "store").manifest.layers
    assert [layer.quantization.name if layer.quantization else None for layer in layers] == [None, "int8"]


def _subcommands():
    """Every subcommand the parser has, found by walking it (not a list kept here)."""
    import argparse

    from moestream.cli import build_parser

    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, action.choices


def test_every_subcommand_formats_its_help():
    parser, commands = _subcommands()
    assert len(commands) >= 12
    top = parser.format_help()
    for name, sub in commands.items():
        assert name in top
        text = sub.format_help()  # raises on a bad help string, e.g. a bare % in it
        assert text.startswith(f"usage: moestream {name}"), name


def test_every_subcommand_help_runs_from_the_command_line():
    _, commands = _subcommands()
    # All at once: each one imports torch and transformers.
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "moestream.cli", name, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name in commands
    }
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} --help: {err}"
        assert out.startswith(f"usage: moestream {name}"), f"{name} --help printed: {out[:200]!r}"


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error:") and "Traceback" not in err, err
    return lines[0]


def test_empty_prompt_is_a_one_line_error_from_the_command_line(store):
    argv = [sys.executable, "-m", "moestream.cli", "generate", str(store), "--prompt", ""]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("moestream: error: --prompt is empty"), done.stderr


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be positive"),
        (["--temperature", "-1"], "--temperature must be 0 or more"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--io-threads", "0"], "--io-threads must be positive"),
        (["--threads", "0"], "--threads must be positive"),
        (["--memory=-1GiB"], "-1GiB"),
        (["--trace-out", "routing.txt"], ".npz"),
    ],
)
def test_bad_generate_options_are_one_line_errors(store, capsys, extra, expected):
    assert main(["generate", str(store), "--prompt", "x", *extra]) == 2
    assert expected in _one_line_error(capsys)


def test_unreadable_text_files_are_one_line_errors(store, tmp_path, capsys):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = {
        str(tmp_path / "missing.txt"): "no such file",
        str(tmp_path): "is a directory",
        str(binary): "is not UTF-8",
        str(empty): "is empty",
    }
    for text, expected in cases.items():
        for argv in (
            ["trace", str(store), "--text", text, "-o", str(tmp_path / "t.npz")],
            ["eval", str(store), "--reference", str(store), "--text", text],
            ["bench", str(store), "--text", text],
        ):
            assert main(argv) == 2, argv
            line = _one_line_error(capsys)
            assert f"--text {text}" in line and expected in line, line


def test_bad_paths_and_sizes_are_one_line_errors(store, tmp_path, capsys):
    for argv, expected in (
        (["simulate", str(tmp_path / "none.npz")], "no such file"),
        (["simulate", str(tmp_path)], "is a directory"),
        (["plan", str(tmp_path / "none.json"), "--trace", str(tmp_path)], "is a directory"),
        (["inspect", str(store), "--memory", "0"], "--memory must be positive"),
        (["convert", str(tmp_path / "none"), str(tmp_path / "out")], "does not exist"),
        (["bench", str(store), "--new-tokens", "1"], "--new-tokens must be at least 2"),
        (["bench", str(store), "--json", str(tmp_path)], "is a directory"),
        (["trace", str(store), "--text", str(tmp_path), "-o", str(tmp_path / "no" / "dir.npz")], "does not exist"),
        (["demo", "--tokens", "0"], "--tokens must be positive"),
        (["verify", str(tmp_path / "none")], "does not exist"),
        (["convert", str(store), str(store / "manifest.json"), "--overwrite"], "is a file"),
        (["plan", str(store), "--compute=-5"], "--compute"),
    ):
        assert main(argv) == 2, argv
        assert expected in _one_line_error(capsys), argv


def test_every_help_works_without_the_optional_extras():
    """Verb modules import FastAPI, uvicorn and matplotlib only when they run."""
    code = """
import argparse, sys
sys.modules["fastapi"] = sys.modules["uvicorn"] = sys.modules["matplotlib"] = None  # as if not installed
from moestream.cli import build_parser
parser = build_parser()
(action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
for name, sub in action.choices.items():
    print(sub.format_help().splitlines()[0])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: moestream serve" in done.stdout and "usage: moestream simulate" in done.stdout, done.stdout


def test_top_level_help_imports_no_verb_module_nor_torch():
    # `moestream --help` lists every verb from cli.py's table; the verb modules (and torch, transformers)
    # are imported only for the verb that runs.
    code = (
        "import sys\n"
        "from moestream.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]\n"
        "verbs = [m for m in sys.modules if m.startswith('moestream.') and m.count('.') >= 2]\n"
        "print(sorted(heavy + verbs))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "generate" in out and "simulate" in out  # the verbs are listed
    assert out.strip().splitlines()[-1] == "[]"


def test_every_verb_help_imports_neither_torch_nor_the_engine():
    """`moestream VERB --help` answers at once: every verb's parser is built from light modules (commands/,
    options, choices) without importing torch, transformers, numpy or the engine."""
    code = """
import sys
from moestream.cli import build_parser
build_parser()
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy', 'safetensors', 'llguidance'))
engine = sorted(m for m in sys.modules if m.startswith(('moestream.core.', 'moestream.conversion.', 'moestream.generation.', 'moestream.server.', 'moestream.tools.')))
print(heavy, engine)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []", done.stdout


def test_the_choices_name_what_the_engine_implements():
    """choices.py holds the names the parsers offer; each must be what its implementation's table takes."""
    import torch

    from moestream import choices
    from moestream.conversion import convert
    from moestream.core.compute import kernels
    from moestream.core.supply import policies
    from moestream.tools import quality

    assert all(policies.policy_class(name).name == name for name in choices.POLICIES)
    assert choices.DEFAULT_POLICY in choices.POLICIES
    assert kernels.COMPUTE_DTYPES == {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}
    assert convert.EXPERT_DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert quality.REFERENCE_DTYPES == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
