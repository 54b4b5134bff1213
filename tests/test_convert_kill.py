"""A conversion killed with SIGKILL at any point leaves nothing loadable at DST, and running it again gives
the same store, byte for byte, as a conversion that was never interrupted.

SIGKILL runs no handler and no `finally`: what it leaves is exactly what a power cut or the OOM killer
leaves, so this checks the write protocol of docs/FORMAT.md ("Writing") rather than the converter's
clean-up code. The kills are timed from outside, by watching the files the converter creates; nothing in
the product knows it is being tested.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

import moestream
from moestream.conversion.store import MANIFEST, Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.errors import StoreError, UsageError
from moestream.units import format_bytes

# fork, SIGKILL and the converter's posix_fadvise: POSIX only, like moestream itself.
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and SIGKILL")

LAYERS = 4
# A Mixtral small enough to convert in about a second, with experts big enough that each experts file
# takes a visible time to write.
CONFIG = dict(
    vocab_size=258,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
# The converter copies the model config into manifest.json, and json.dump with indent= encodes in pure
# Python: a long list in the config keeps manifest.json.partial on disk for a few hundred milliseconds,
# long enough to be seen and killed. A real config is small, so that window is otherwise microseconds.
PADDING = 200_000

# Runs conversions in processes forked from one that has already imported torch and transformers (nine
# seconds on a slow core, once instead of once per conversion). Each child is a complete `moestream
# convert` (moestream.cli.main) with its own PID, killed from the test process like any other process;
# the forking process waits for it and reports how it ended. Fork is safe here: the server has run no
# torch operation yet, so no thread pool exists to be lost in the child.
SERVER = r"""
import json, os, sys, traceback, warnings
from moestream.cli import main
import transformers.models.mixtral.modeling_mixtral  # the model code the converter's skeleton needs
warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    argv, log = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = main(argv)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)
"""


class Converter:
    """Starts `moestream convert SRC DST` processes and reports how each ended."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.server_log = workdir / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.server_log, "wb"),
            text=True,
        )
        self.runs = 0

    def _message(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the conversion server died:\n{self.server_log.read_text()}")
        return json.loads(line)

    def ready(self) -> None:
        assert "ready" in self._message()

    def start(self, src: Path, dst: Path) -> tuple[int, Path]:
        """Start a conversion; its PID and the log its output goes to."""
        self.runs += 1
        log = self.workdir / f"convert-{self.runs}.log"
        self.proc.stdin.write(json.dumps([["convert", str(src), str(dst)], str(log)]) + "\n")
        self.proc.stdin.flush()
        return self._message()["pid"], log

    def wait(self) -> dict:
        """How the last conversion ended: {"signal": n or None, "exit": n or None}."""
        return self._message()

    def run(self, src: Path, dst: Path) -> None:
        """One conversion to completion."""
        _, log = self.start(src, dst)
        status = self.wait()
        assert status == {"signal": None, "exit": 0}, f"conversion failed ({status}):\n{log.read_text()}"

    def close(self) -> None:
        # No conversion is running between tests; killing skips the seconds torch takes to shut down.
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    conv = Converter(tmp_path_factory.mktemp("converter"))
    yield conv
    conv.close()


@pytest.fixture(scope="module")
def checkpoint(converter, tmp_path_factory):
    # Built while the conversion server imports (the `converter` fixture has already started it).
    model = make_model("mixtral", seed=11, **CONFIG)
    model.config.padding = list(range(PADDING))
    path = save_checkpoint(model, tmp_path_factory.mktemp("kill") / "hf")
    converter.ready()
    return path


@pytest.fixture(scope="module")
def reference(converter, checkpoint, tmp_path_factory):
    """An uninterrupted conversion, from a process of its own like the others."""
    dst = tmp_path_factory.mktemp("reference") / "store"
    converter.run(checkpoint, dst)
    Store(dst)
    return dst


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under root by relative path: a file's bytes, None for a directory."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            out[os.path.relpath(os.path.join(dirpath, f), root)] = Path(dirpath, f).read_bytes()
    return out


def _assert_same_store(actual: Path, expected: Path) -> None:
    a, b = _tree(actual), _tree(expected)
    assert sorted(a) == sorted(b), "the stores hold different files"
    different = [name for name in a if a[name] != b[name]]
    assert not different, f"these files differ from an uninterrupted conversion: {different}"


def _partial_dirs(dst: Path) -> list[Path]:
    return sorted(dst.parent.glob(f".{dst.name}.partial-*"))


# Where to kill: a condition on the converter's temporary directory, true from some point of the
# conversion on until the final rename. Listed in the order the converter reaches them.
KillPoint = namedtuple("KillPoint", "id condition")
KILL_POINTS = [
    # The first experts file is opened microseconds later, so this kill lands while it is being written.
    KillPoint("temporary-directory-created", lambda part: part.is_dir()),
    KillPoint("first-experts-file-complete", lambda part: (part / "experts" / "layer-001.bin").is_file()),
    KillPoint("last-experts-file-started", lambda part: (part / "experts" / f"layer-{LAYERS - 1:03d}.bin").is_file()),
    KillPoint("resident-weights-written", lambda part: (part / "resident-00001.safetensors").is_file()),
    KillPoint("manifest-being-written", lambda part: (part / (MANIFEST + ".partial")).is_file()),
]


def _kill_when(pid: int, part: Path, point: KillPoint, timeout: float = 120.0) -> list[str]:
    """SIGKILL `pid` as soon as `point` holds; what the temporary directory held at that moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if point.condition(part):
            os.kill(pid, signal.SIGKILL)
            return sorted(str(p.relative_to(part)) for p in part.rglob("*")) if part.is_dir() else []
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # ended (and reaped by the server) before the point was seen
            return ["<the conversion had already ended>"]
        time.sleep(0.001)
    pytest.fail(f"the conversion did not reach {point.id} in {timeout:.0f} s")


@pytest.mark.parametrize("point", KILL_POINTS, ids=[p.id for p in KILL_POINTS])
def test_killed_conversion_reruns_to_the_same_store(converter, checkpoint, reference, tmp_path, point):
    dst = tmp_path / "store"
    pid, log = converter.start(checkpoint, dst)
    part = tmp_path / f".store.partial-{pid}"
    seen = _kill_when(pid, part, point)
    print(f"killed at {point.id}, holding {seen}")  # shown with -s or on failure
    status = converter.wait()
    # A kill that came too late would make this test pass without testing anything: say so instead.
    assert status["signal"] == signal.SIGKILL, (
        f"the conversion ended ({status}) before it could be killed at {point.id} (it held {seen}); the "
        f"checkpoint converts too fast for this kill point, make it bigger. Log:\n{log.read_text()}"
    )
    # Killed before the final rename: the temporary directory is left behind and DST does not load.
    assert part.is_dir() and point.condition(part), f"killed at {point.id}, holding {seen}"
    if dst.exists():
        with pytest.raises(StoreError):
            Store(dst)

    converter.run(checkpoint, dst)  # a new process: it removes the dead one's temporary directory
    assert _partial_dirs(dst) == []
    _assert_same_store(dst, reference)


def test_full_disk_is_a_clear_error_naming_the_space_needed(tmp_path, monkeypatch):
    model = make_model("mixtral", seed=3, **dict(CONFIG, num_hidden_layers=2, hidden_size=32, intermediate_size=64))
    src = save_checkpoint(model, tmp_path / "hf")
    # What the converter should ask for: the store's tensor bytes (resident files without their
    # safetensors headers, expert records as stored) plus its 64 MiB of headroom.
    manifest = Store(moestream.convert(src, tmp_path / "sized", progress=False)).manifest
    resident = 0
    for f in manifest.resident_files:
        with open(tmp_path / "sized" / f.path, "rb") as fh:
            resident += f.size - 8 - int.from_bytes(fh.read(8), "little")
    experts = sum(layer.layout.stride * layer.num_experts for layer in manifest.layers)
    need = resident + experts + 64 * 2**20

    converter_module = sys.modules["moestream.conversion.convert"]  # the package's `convert` attribute is the function
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(converter_module.shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 5 * 2**20, 5 * 2**20))
    with pytest.raises(UsageError) as info:
        moestream.convert(src, tmp_path / "out", progress=False)
    message = str(info.value)
    assert f"the store needs about {format_bytes(need)}, {format_bytes(5 * 2**20)} is free" in message, message
    assert "not enough disk space" in message and "Free space or choose another destination" in message
    assert not (tmp_path / "out").exists() and _partial_dirs(tmp_path / "out") == []
