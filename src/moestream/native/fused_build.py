"""Building native/fused_kernels.cpp into a Python extension module, once per (source, flags, torch build,
Python ABI), and loading it from a cache without locks.

Why not torch's `cpp_extension.load_inline`, which did this before (docs/DECISIONS.md, "Building the fused
kernels", has the measurements):
- its cache is keyed by the extension's name alone, so a changed source under the same name loaded a stale
  module, and two environments with different torch builds rebuilt and evicted each other's module in turn;
- its build holds a lock file in the shared cache directory: a process killed mid-build (Ctrl-C during a
  first load) left the lock, and every later start waited on it silently;
- importing it costs about a second (it imports setuptools), and it runs ninja for one file.
Here the cache file's name carries a hash of everything the binary depends on (`cache_key`), a build runs in
a private temporary directory and its result is renamed into the cache (atomic on one filesystem), and a
process that finds the file imports it directly. Two processes building at once both build; the later
rename wins, with the same bytes. A temporary directory left by a killed build is never waited for, and
is removed once it is older than any build can run (`clean_abandoned`).

Compile time is what the first load waits for; the source includes only the ATen headers it uses rather
than <torch/extension.h>, which halved it (see fused_kernels.cpp's first lines). -O3 rather than -O2 costs
about a second of it and makes the RMSNorm and rotary kernels 2-3x faster (gcc 12 vectorizes their dtype
conversions only at -O3; the same bits either way). -ffp-contract=off keeps the compiler from fusing a
multiply and an add into one rounding, which would change the kernels' numbers (they must give the model's
own bits).

Without a compiler, with a failed build, or with MOESTREAM_FUSED=0, `load` returns None and prints one
line naming the kernels that are off and why; `unavailable_reason()` returns that reason.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "fused_kernels.cpp"
# -fopenmp (Linux): at::parallel_for is OpenMP inside ATen's headers, so without it every kernel here ran on
# one thread. The module then needs libgomp.so.1, which torch's own libraries have loaded already. Apple's
# clang has no -fopenmp: there the kernels keep to the calling thread, as before.
_OPENMP = ("-fopenmp",) if sys.platform.startswith("linux") else ()
FLAGS = ("-std=c++20", "-O3", "-ffp-contract=off", *_OPENMP, "-fPIC", "-fvisibility=hidden", "-shared")
LIBRARIES = ("c10", "torch_cpu", "torch", "torch_python")
EXPECTED_SECONDS = 30  # one build: 32-37 s of one core of a busy 2-core AMD EPYC (docs/BENCHMARKS.md, "Start-up")
BUILD_TIMEOUT_SECONDS = 900  # a compiler that has not finished by then has hung
ABANDONED_SECONDS = 2 * BUILD_TIMEOUT_SECONDS  # a build directory this old was left by a killed process
_BUILD_PREFIX = ".build-"

_lock = threading.Lock()  # one load or build at a time in this process (a background `start` and `load`)
_loaded: dict[str, object] = {}  # cache key -> the imported module
_failed: dict[str, str] = {}  # cache key -> why it could not be had (not tried again in this process)
_reason: str | None = None  # why the last `load` returned None
_told: set[str] = set()  # reasons already printed
_background: threading.Thread | None = None


_LOCAL_INCLUDE = re.compile(r'^#include "(\w+\.h)"$', re.MULTILINE)


def read_source() -> str:
    """The source as compiled: fused_kernels.cpp with the headers of this directory it includes written in
    place, so that one text is hashed (`cache_key`) and compiled."""
    return _LOCAL_INCLUDE.sub(lambda m: (SOURCE.parent / m.group(1)).read_text(), SOURCE.read_text())


def kernel_names(source: str | None = None) -> list[str]:
    """The kernels the module exports, as its PYBIND11_MODULE block names them (`m.def("name", ...)`)."""
    text = read_source() if source is None else source
    return re.findall(r'\bm\.def\(\s*"(\w+)"', text)


def torch_build() -> tuple[str, str]:
    """(torch.__version__, torch's git commit): two builds of one version (CPU and CUDA wheels, a local
    build) differ in the second or the first."""
    return torch.__version__, str(getattr(torch.version, "git_version", "unknown"))


def python_abi() -> str:
    """The interpreter's extension-module ABI, e.g. `.cpython-311-x86_64-linux-gnu.so`."""
    return str(sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag)


def _abi_defines() -> list[str]:
    """The C++ ABI defines the extension must share with torch's own libraries (as torch's builder passes
    them: the libstdc++ string ABI; the pybind11 ABI on older torch builds, which export it)."""
    defines = []
    if hasattr(torch._C, "_GLIBCXX_USE_CXX11_ABI"):
        defines.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            defines.append(f'-DPYBIND11_{name}="{value}"')
    return defines


def cache_key(source: str, flags: list[str] | tuple[str, ...], torch_version: str, torch_git: str, abi: str) -> str:
    """A hash of everything the built module depends on; its file name in the cache carries it, so a changed
    source, other flags, another torch build or another Python never load a module built for something else,
    and environments that differ keep one file each instead of rebuilding over each other."""
    blob = json.dumps([source, list(flags), torch_version, torch_git, abi])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_directory() -> Path:
    """Where built modules are kept: $MOESTREAM_KERNELS_DIR, else moestream/ under $TORCH_EXTENSIONS_DIR
    (where torch keeps its extensions, if the user chose a place), else ~/.cache/moestream/kernels
    ($XDG_CACHE_HOME honoured)."""
    if os.environ.get("MOESTREAM_KERNELS_DIR"):
        return Path(os.environ["MOESTREAM_KERNELS_DIR"])
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "moestream"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moestream" / "kernels"


def _compiler() -> list[str] | None:
    """The C++ compiler's command ($CXX, as torch's builder honours it, else c++), or None if not found."""
    argv = shlex.split(os.environ.get("CXX") or "c++")
    if not argv or shutil.which(argv[0]) is None:
        return None
    return argv


def _command(compiler: list[str], name: str, source: Path, output: Path) -> list[str]:
    """One compile-and-link of the single source file into the module `output`."""
    root = Path(torch.__file__).parent
    include = root / "include"
    command = [*compiler, *FLAGS, f"-DTORCH_EXTENSION_NAME={name}", *_abi_defines()]
    for path in (include, include / "torch" / "csrc" / "api" / "include", Path(sysconfig.get_paths()["include"])):
        command += ["-isystem", str(path)]
    command += [str(source), "-o", str(output), f"-L{root / 'lib'}", *(f"-l{lib}" for lib in LIBRARIES)]
    if sys.platform == "darwin":  # Python's own symbols resolve when the interpreter loads the module
        command += ["-undefined", "dynamic_lookup"]
    return command


def clean_abandoned(directory: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary build directories older than ABANDONED_SECONDS: no build runs that long (one is
    stopped at BUILD_TIMEOUT_SECONDS), so such a directory is what a killed process left. Younger ones are
    left alone, whoever's they are (a pid says little across hosts or containers sharing the cache), and
    nothing ever waits for them: each build has a directory of its own. Returns what it removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = [entry for entry in directory.iterdir() if entry.name.startswith(_BUILD_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            age = now - entry.stat().st_mtime
        except OSError:
            continue
        if age > ABANDONED_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _cap_lowbit_isa(module)
    return module


def _cap_lowbit_isa(module) -> None:
    """MOESTREAM_LOWBIT_ISA=avx2 (or portable) runs the int8-activation loops of a plainer CPU on this one,
    as ATEN_CPU_CAPABILITY does for torch's: to time the variants side by side, or to test a plainer CPU's
    path. A value it does not know is said once and ignored."""
    cap = os.environ.get("MOESTREAM_LOWBIT_ISA")
    if cap and hasattr(module, "lowbit_isa"):
        try:
            module.lowbit_isa(cap)
        except RuntimeError as e:
            print(f"moestream: MOESTREAM_LOWBIT_ISA ignored: {str(e).splitlines()[0]}", file=sys.stderr)


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    line = (errors or lines or ["no output"])[0]
    return line if len(line) <= 200 else line[:197] + "..."


class Unavailable(Exception):
    """Why the kernels cannot be had here (its message is the reason `unavailable_reason` returns)."""


def _build(compiler: list[str], directory: Path, name: str, source: str, target: Path) -> None:
    """Compile into a private temporary directory, then rename the module into the cache."""
    directory.mkdir(parents=True, exist_ok=True)
    clean_abandoned(directory)
    work = Path(
        tempfile.mkdtemp(prefix=f"{_BUILD_PREFIX}{name}-{os.getpid()}-", suffix=f"@{socket.gethostname()}", dir=directory)
    )
    try:
        (work / "fused_kernels.cpp").write_text(source)
        command = _command(compiler, name, work / "fused_kernels.cpp", work / f"{name}.so")
        print(
            f"moestream: compiling the fused CPU kernels for this torch build, once (about {EXPECTED_SECONDS} s); "
            "MOESTREAM_FUSED=0 skips them",
            file=sys.stderr,
            flush=True,
        )
        try:
            done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired as error:
            raise Unavailable(f"the C++ build did not finish in {BUILD_TIMEOUT_SECONDS} s") from error
        except OSError as error:
            raise Unavailable(f"the C++ compiler {compiler[0]} did not run: {error}") from error
        if done.returncode != 0:
            log = directory / f"{name}.log"
            log.write_text(shlex.join(command) + "\n\n" + done.stdout + done.stderr)
            first = _first_error(done.stderr + done.stdout)
            raise Unavailable(f"the C++ build failed, {compiler[0]} exited with {done.returncode}: {first} (log: {log})")
        os.replace(work / f"{name}.so", target)  # atomic: a reader sees no file or a whole one
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load():
    if os.environ.get("MOESTREAM_FUSED", "1") == "0":
        raise Unavailable("MOESTREAM_FUSED=0")
    if sys.platform == "win32":
        raise Unavailable("built on Linux and macOS only")
    source = read_source()
    key = _key(source)
    if key in _loaded:
        return _loaded[key]
    if key in _failed:
        raise Unavailable(_failed[key])
    try:
        module = _build_and_import(key, source)
    except Unavailable as error:
        _failed[key] = str(error)
        raise
    _loaded[key] = module
    return module


def _key(source: str) -> str:
    """The cache key of this source as this process would build it (flags, torch build, Python ABI)."""
    return cache_key(source, FLAGS + tuple(_abi_defines()), *torch_build(), python_abi())


def _module_path(key: str) -> tuple[str, Path]:
    """(module name, the cached file's path) of a build with this key."""
    name = f"moestream_fused_{key}"
    return name, cache_directory() / f"{name}.so"


def _build_and_import(key: str, source: str):
    name, target = _module_path(key)
    directory = target.parent
    built = False
    if not target.exists():
        _build_or_explain(directory, name, source, target)
        built = True
    try:
        module = _import(name, target)
    except ImportError as error:
        if built:
            raise Unavailable(f"the built module {target} did not load: {error}") from error
        # A cached file that does not load (damaged on disk): built again, once.
        target.unlink(missing_ok=True)
        _build_or_explain(directory, name, source, target)
        try:
            module = _import(name, target)
        except ImportError as again:
            raise Unavailable(f"the built module {target} did not load: {again}") from again
    clean_abandoned(directory)  # a killed build's directory, whoever's (a listing; it waits for nothing)
    return module


def _build_or_explain(directory: Path, name: str, source: str, target: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise Unavailable(f"no C++ compiler: {os.environ.get('CXX') or 'c++'} not found; install g++ or set CXX")
    try:
        _build(compiler, directory, name, source, target)
    except OSError as error:
        raise Unavailable(f"cannot build in {directory} ({error}); set MOESTREAM_KERNELS_DIR to a writable place") from error


def load():
    """The compiled kernels' module (built first if this source, torch build and Python have none cached),
    or None: MOESTREAM_FUSED=0, no compiler, a failed build. Then one line on stderr names the kernels that
    are off and why (once per reason per process), and `unavailable_reason()` returns the why."""
    global _reason
    with _lock:
        try:
            module = _load()
        except Unavailable as error:
            _reason = str(error)
            if _reason not in _told:
                _told.add(_reason)
                print(
                    f"moestream: fused CPU kernels off ({_reason}): {', '.join(kernel_names())} run as the model's own torch ops",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        _reason = None
        return module


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled kernels for this process, or None (MOESTREAM_FUSED=0, no compiler, a failed build):
    `load` once, then remembered, since the kernels' callers ask for it on every call."""
    return load()


def load_if_built():
    """The compiled kernels if a module for this source and torch build is loaded or cached already, else
    None: never builds, never waits for a build under way, says nothing (for work that has a slower way
    of its own, such as the converter's nibble re-pairing)."""
    if os.environ.get("MOESTREAM_FUSED", "1") == "0" or sys.platform == "win32" or not _lock.acquire(blocking=False):
        return None
    try:
        key = _key(read_source())
        if key in _loaded:
            return _loaded[key]
        name, target = _module_path(key)
        if key in _failed or not target.exists():
            return None
        try:
            _loaded[key] = _import(name, target)
        except ImportError:  # damaged: `load` builds it again when the engine needs it
            return None
        return _loaded[key]
    finally:
        _lock.release()


def unavailable_reason() -> str | None:
    """None when the kernels load, else why not (a line for a user). Runs `load`, which is instant once it
    has loaded or failed for this source and torch build in this process."""
    load()
    return _reason


def start() -> None:
    """Begin `load` (and so a build, if one is needed) on a background thread, so that work done meanwhile
    (building a checkpoint, opening a store) hides the compile; a later `load` waits for it (`_lock`)."""
    global _background
    with _lock:
        if _background is not None or _loaded:
            return
        _background = threading.Thread(target=load, name="moestream-fused-build", daemon=True)
        _background.start()


class WhenBuilt:
    """The compiled kernels' block readers for work with a slower way of its own (the converter's): each
    answers None until the kernels are built (looked for at most once a second), then their result."""

    def __init__(self):
        self.ext, self.looked = None, float("-inf")

    def _built(self):
        if self.ext is None and time.monotonic() - self.looked >= 1.0:
            self.looked = time.monotonic()
            self.ext = load_if_built()
        return self.ext

    def repair_nibbles(self, *args):
        ext = self._built()
        return None if ext is None else ext.repair_nibbles(*args)

    def q6_k_int8(self, *args):
        ext = self._built()
        return None if ext is None else ext.q6_k_int8(*args)

    def q6_k_int4(self, *args):
        ext = self._built()
        return None if ext is None else ext.q6_k_int4(*args)
