"""Building and caching the fused kernels (native/fused_build.py): the cache key, builds that wait for nothing a
killed build left, two builds at once, and a machine whose compiler fails (the model runs as with
MOESTREAM_FUSED=0, one line says so). Builds here use a stand-in compiler that copies the module the session
built (tests/conftest.py), so they take milliseconds, not a compile."""

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from tiny import tiny_checkpoint

import moestream
from moestream.native import fused_build

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the fused kernels are not built")


def test_the_cache_key_changes_with_the_source_flags_torch_build_and_python():
    base = ("// source", ("-O3",), "2.13.0+cpu", "abc123", ".cpython-311-x86_64-linux-gnu.so")
    key = fused_build.cache_key(*base)
    assert key == fused_build.cache_key(*base)
    changed = [
        ("// source, edited", *base[1:]),
        (base[0], ("-O2",), *base[2:]),
        (*base[:2], "2.13.0+cu128", *base[3:]),  # another wheel of the same version
        (*base[:3], "def456", base[4]),  # a local build of the same version string
        (*base[:4], ".cpython-312-x86_64-linux-gnu.so"),
    ]
    keys = {fused_build.cache_key(*args) for args in changed}
    assert key not in keys and len(keys) == len(changed)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MOESTREAM_KERNELS_DIR", raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fused_build.cache_directory() == tmp_path / "xdg" / "moestream" / "kernels"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert fused_build.cache_directory() == tmp_path / "torch" / "moestream"
    monkeypatch.setenv("MOESTREAM_KERNELS_DIR", str(tmp_path / "ours"))
    assert fused_build.cache_directory() == tmp_path / "ours"


def test_the_source_names_its_kernels():
    names = fused_build.kernel_names()
    assert {"rms_norm", "rotary", "softmax_topk_router", "experts_decode"} <= set(names)


# -- builds with a stand-in compiler -------------------------------------------------------------------------


@pytest.fixture
def built() -> Path:
    """The module the session built (conftest), which the stand-in compiler copies."""
    module = fused_build.load()
    assert module is not None, "a C++ compiler is here, so the extension must build"
    return Path(module.__file__)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache and a process that has loaded nothing from it yet."""
    directory = tmp_path / "kernels"
    monkeypatch.setenv("MOESTREAM_KERNELS_DIR", str(directory))
    monkeypatch.delenv("MOESTREAM_FUSED", raising=False)
    monkeypatch.setattr(fused_build, "_loaded", {})
    monkeypatch.setattr(fused_build, "_failed", {})
    monkeypatch.setattr(fused_build, "_told", set())
    return directory


def _stand_in_compiler(tmp_path: Path, built: Path, delay: float = 0.0) -> str:
    """A CXX that records its arguments and copies `built` to its -o, after `delay` seconds."""
    script = tmp_path / "cxx.py"
    script.write_text(
        textwrap.dedent(f"""
            import shutil, sys, time
            args = sys.argv[1:]
            with open({str(tmp_path / "args.txt")!r}, "a") as f:
                f.write(" ".join(args) + "\\n")
            time.sleep({delay})
            shutil.copy({str(built)!r}, args[args.index("-o") + 1])
        """)
    )
    return f"{sys.executable} {script}"


@needs_compiler
def test_a_build_renames_its_module_into_the_cache_and_leaves_nothing_else(monkeypatch, tmp_path, built, fresh):
    monkeypatch.setenv("CXX", _stand_in_compiler(tmp_path, built))
    module = fused_build.load()
    assert module is not None and fused_build.unavailable_reason() is None
    assert [p.name for p in fresh.iterdir()] == [Path(module.__file__).name]  # no build directory, no lock
    args = (tmp_path / "args.txt").read_text()
    assert "-ffp-contract=off" in args and "-O3" in args  # the kernels' numbers and speed depend on both
    assert f"-DTORCH_EXTENSION_NAME={Path(module.__file__).stem}" in args


@needs_compiler
def test_what_a_killed_build_left_makes_nothing_wait_and_is_removed_once_old(monkeypatch, tmp_path, built, fresh):
    """Build directories left by killed processes, each with the lock file torch's builder would have
    waited on: a build goes ahead at once, and removes those older than any build runs."""
    fresh.mkdir(parents=True)
    name = built.stem
    killed_now = fresh / f".build-{name}-{2**22 + 1}-abc@{socket.gethostname()}"  # killed a moment ago
    killed_long_ago = fresh / f".build-{name}-{2**22 + 2}-def@another-host"
    for directory in (killed_now, killed_long_ago):
        directory.mkdir()
        (directory / "lock").write_text("")
        (directory / f"{name}.so").write_bytes(b"half written")
    old = time.time() - fused_build.ABANDONED_SECONDS - 60
    os.utime(killed_long_ago, (old, old))
    monkeypatch.setenv("CXX", _stand_in_compiler(tmp_path, built))

    result = []
    loading = threading.Thread(target=lambda: result.append(fused_build.load()), daemon=True)
    loading.start()
    loading.join(timeout=30)
    assert not loading.is_alive(), "a build waited on what a killed build left"
    assert result[0] is not None
    assert (fresh / built.name).read_bytes() == built.read_bytes()
    assert killed_now.exists() and not killed_long_ago.exists()


@needs_compiler
def test_a_damaged_cached_module_is_built_again(monkeypatch, tmp_path, built, fresh):
    monkeypatch.setenv("CXX", _stand_in_compiler(tmp_path, built))
    fresh.mkdir(parents=True)
    (fresh / built.name).write_bytes(b"not a shared object")
    assert fused_build.load() is not None
    assert (fresh / built.name).read_bytes() == built.read_bytes()


@needs_compiler
def test_two_processes_building_at_once_both_load(monkeypatch, tmp_path, built, fresh):
    """No lock: while another process builds (its stand-in compiler takes two seconds), this one builds
    too; both rename, both import."""
    monkeypatch.setenv("CXX", _stand_in_compiler(tmp_path, built, delay=2.0))
    code = "from moestream.native import fused_build; assert fused_build.load() is not None"
    other = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    args = tmp_path / "args.txt"
    deadline = time.monotonic() + 120
    while not args.exists() and other.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the other's compiler runs
    assert fused_build.load() is not None
    assert other.wait(timeout=120) == 0, other.stderr.read()
    assert len(args.read_text().splitlines()) == 2
    assert [p.name for p in fresh.iterdir()] == [built.name]


# -- without kernels --------------------------------------------------------------------------------------------


def test_without_a_compiler_one_line_says_which_kernels_are_off_and_why(monkeypatch, capsys, fresh):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert fused_build.load() is None
    reason = fused_build.unavailable_reason()
    assert "no C++ compiler" in reason and "/nonexistent/c++" in reason
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: fused CPU kernels off (no C++ compiler")
    assert "rms_norm" in lines[0] and "rotary" in lines[0]
    assert not fresh.exists() or not any(fresh.iterdir())


def test_moestream_fused_0_is_the_reason(monkeypatch, capsys, fresh):
    monkeypatch.setenv("MOESTREAM_FUSED", "0")
    assert fused_build.load() is None and fused_build.unavailable_reason() == "MOESTREAM_FUSED=0"
    assert capsys.readouterr().err.count("\n") == 1


_LOGITS = """
import sys, torch, moestream
from moestream.core.compute import fused
from moestream.native import fused_build
torch.manual_seed(0)
ids = torch.randint(0, 100, (1, 9))
def logits():
    fused_build.extension.cache_clear()
    model, _ = moestream.load(sys.argv[1], "1MiB")
    with torch.no_grad():
        out = model(ids).logits
    moestream.close(model)
    return out
broken = logits()
print("REASON", fused.unavailable_reason(), flush=True)
import os; os.environ["MOESTREAM_FUSED"] = "0"
assert torch.equal(broken, logits()), "a failed build must leave the model exactly as MOESTREAM_FUSED=0 does"
"""


def test_with_a_broken_compiler_the_model_runs_as_with_moestream_fused_0(tmp_path):
    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=3)
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    env = dict(os.environ, CXX="/bin/false", MOESTREAM_KERNELS_DIR=str(tmp_path / "kernels"))
    env.pop("MOESTREAM_FUSED", None)
    done = subprocess.run([sys.executable, "-c", _LOGITS, str(store)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "REASON the C++ build failed, /bin/false exited with 1" in done.stdout
    off = [line for line in done.stderr.splitlines() if "fused CPU kernels off" in line]
    assert len(off) == 2  # one line for the failed build, one for MOESTREAM_FUSED=0
    assert off[0].startswith("moestream: fused CPU kernels off (the C++ build failed") and "rms_norm" in off[0]
