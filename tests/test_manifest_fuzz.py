"""Fuzzing the manifest reader: any manifest.json either loads or is refused with a StoreError.

A store directory may be damaged, truncated, edited by hand or written by something else, so the reader
must never fail with a bare TypeError, KeyError, ValueError, OSError or RecursionError: the CLI prints a
MoestreamError as one clear line, anything else as a traceback. The inputs start from a real manifest
written by the converter and mutate it (replace a subtree with arbitrary JSON, delete a key, change a
value's type), because a purely random document is refused at the first field and never reaches the
deeper checks. Raw bytes cover what the JSON decoder itself may raise.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiny import TINY, tiny_checkpoint

import moestream
from moestream.conversion.store import MANIFEST, Store, parse_manifest
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.errors import StoreError

# Explicit so that CI runs this many examples whatever the hypothesis profile says. No example database:
# runs do not depend on earlier ones, and a failure prints the falsifying input anyway. (Hypothesis still
# keeps caches in .hypothesis/, which it git-ignores itself.)
FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Strings that exercise paths and encodings: traversal, absolute paths, NUL, lone surrogates (which json
# decodes from "\ud800" but the filesystem cannot encode), names longer than NAME_MAX, the store's own
# directories and files, and a name inside the store reached through "..".
NASTY_TEXT = [
    "",
    ".",
    "..",
    "/",
    "../x",
    "../../etc/passwd",
    "/etc/passwd",
    "//etc/passwd",
    "experts/../../outside",
    "experts/../experts/layer-000.bin",
    "./experts/layer-000.bin",
    "experts",
    "experts/",
    "experts/layer-000.bin/",
    "manifest.json",
    "resident-00001.safetensors",
    "a\x00b",
    "\x00",
    "experts/layer-000.bin\x00",
    "\ud800",
    "\udcff",
    "a" * 300,
    "a/" * 3000,
    "~",
    "C:\\Windows",
    "model_type",
    "mixtral",
    "float32",
    "bfloat16",
    "moestream-store",
]
NASTY_INTS = [0, 1, -1, 63, 64, 4095, 4096, 4097, 8192, -4096, 2**31, 2**53 + 1, 2**63, -(2**63), 2**64, 10**100, -(10**100)]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(NASTY_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(NASTY_TEXT),
)
KEYS = st.one_of(st.text(max_size=8), st.sampled_from(NASTY_TEXT + ["path", "file", "offset", "dtype", "size"]))
# Whole documents: hypothesis' recursive strategy, any JSON shape.
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(KEYS, children, max_size=3)),
    max_leaves=5,
)


def _json_tree(depth: int):
    """Arbitrary JSON nested at most `depth` deep, for replacing a subtree of the manifest.

    The same values as json_values at a third of the cost per example (st.recursive spends about 3 ms a
    draw on a slow core): with 10,000 examples that is the difference between 40 s and 80 s. Depth 2 is
    enough, since the parser never descends into a value it does not expect.
    """
    child = _json_tree(depth - 1) if depth else None
    kind, size = st.integers(0, 9), st.integers(0, 3)

    @st.composite
    def tree(draw):
        k = draw(kind) if child is not None else 0
        if k == 8:
            return [draw(child) for _ in range(draw(size))]
        if k == 9:
            return {draw(KEYS): draw(child) for _ in range(draw(size))}
        return draw(scalars)

    return tree()


subtrees = _json_tree(2)


def _nodes(tree) -> list:
    """Every (path, value) in a JSON tree, the root included; a path is a tuple of keys and indices."""
    out, stack = [], [((), tree)]
    while stack:  # iterative: nested generators cost more than the parser under test
        path, value = stack.pop()
        out.append((path, value))
        if isinstance(value, dict):
            stack.extend((path + (k,), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((path + (i,), v) for i, v in enumerate(value))
    return out


def _parent(tree, path):
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _retyped(value):
    """The same information in other JSON types: 4096 -> 4096.0, "4096", [4096], {...}, True."""
    out = [[value], {"value": value}, str(value), None]
    if isinstance(value, bool):
        out += [int(value), "true"]
    elif isinstance(value, int):
        out += [float(value), value + 1, -value, value * 4096 + 1, 2**64 + value, bool(value % 2)]
    elif isinstance(value, float):
        out += [int(value) if value == value and abs(value) != float("inf") else 0]
    elif isinstance(value, str):
        out += [value.encode("utf-8", "surrogatepass").hex(), value + "\x00", "../" + value, "/" + value, value * 2, len(value)]
    elif isinstance(value, list):
        out += [value[:-1], value + value[-1:], list(reversed(value)), dict(enumerate(value)), []]
    elif isinstance(value, dict):
        out += [list(value.values()), list(value), {}]
    return out


# Built once: hypothesis computes properties of every new strategy object, which is slow inside a loop.
MUTATIONS = st.integers(1, 3)
ANY_INDEX = st.integers(0, 2**16)  # taken modulo the number of choices, which changes with each mutation
MUTATION_KINDS = st.sampled_from(["replace", "retype", "delete", "add_key"])


@st.composite
def mutated(draw, manifest_text):
    """The manifest with one to three structural mutations, each at a node chosen uniformly."""
    tree = json.loads(manifest_text)  # a fresh copy, faster than deepcopy
    for _ in range(draw(MUTATIONS)):
        nodes = _nodes(tree)
        path, value = nodes[draw(ANY_INDEX) % len(nodes)]
        kind = draw(MUTATION_KINDS)
        if kind == "retype":
            choices = _retyped(value)
            new = choices[draw(ANY_INDEX) % len(choices)]
        elif kind == "add_key" and isinstance(value, dict):
            value[draw(KEYS)] = draw(subtrees)
            continue
        elif kind != "replace" and path:  # delete (add_key on a non-object deletes instead)
            del _parent(tree, path)[path[-1]]
            continue
        else:
            new = draw(subtrees)
        if path:
            _parent(tree, path)[path[-1]] = new
        else:
            tree = new
    return tree


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """Real stores (each converted once) whose manifests the mutations start from: float experts, and
    quantized ones (an int4 layer and an int8 layer) so that `quantization` is there to mutate."""
    root = tmp_path_factory.mktemp("fuzz")
    _, ckpt = tiny_checkpoint("mixtral", root / "hf", seed=7)
    float_store = moestream.convert(ckpt, root / "float", progress=False)
    # int4 needs every experts matrix's inputs to be a multiple of its group size.
    model = make_model("mixtral", seed=7, **dict(TINY["mixtral"], intermediate_size=32))
    quantized = moestream.convert(
        save_checkpoint(model, root / "hf-quantized"),
        root / "quantized",
        "int4",
        layer_dtypes=["1=int8"],
        group_size=32,
        progress=False,
    )
    return {"float": float_store, "quantized": quantized}


@pytest.fixture(scope="module")
def pristine(seeds):
    return seeds["float"], json.loads((seeds["float"] / MANIFEST).read_text())


@pytest.fixture(scope="module")
def scratch(seeds, tmp_path_factory):
    """Copies of the stores whose manifest.json each example overwrites (the data files stay intact)."""
    copies = {}
    for name, store in seeds.items():
        copies[name] = tmp_path_factory.mktemp(f"fuzz-{name}") / "store"
        shutil.copytree(store, copies[name])
    return copies


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _assert_sound(directory: Path, manifest) -> None:
    """What a successful parse guarantees: every path it returns stays inside the store, and every
    number the reader computes with is an int (4096.0 or True would break offsets and reshapes later)."""
    root = os.path.realpath(directory)
    paths = [f.path for f in manifest.resident_files] + [layer.file for layer in manifest.layers] + list(manifest.extra_files)
    for rel in paths:
        assert isinstance(rel, str) and rel and "\x00" not in rel and not os.path.isabs(rel), rel
        full = os.path.realpath(os.path.join(root, rel))
        assert os.path.commonpath([root, full]) == root and full != root, f"{rel!r} resolves to {full}, outside {root}"
    assert _is_int(manifest.resident_bytes) and all(_is_int(f.size) for f in manifest.resident_files)
    for layer in manifest.layers:
        assert _is_int(layer.index) and all(_is_int(o) and o >= 0 for o in layer.offsets)
        for t in layer.layout.tensors:
            assert _is_int(t.offset) and all(_is_int(d) and d >= 0 for d in t.shape), t
        q = layer.quantization
        if q is not None:
            assert q.group_size is None or _is_int(q.group_size), q
            assert q.packing is None or isinstance(q.packing, str), q


def _write_manifest(directory: Path, data: bytes) -> None:
    # Unlink first: truncating a file in place costs a data flush per write on ext4 (auto_da_alloc).
    (directory / MANIFEST).unlink(missing_ok=True)
    (directory / MANIFEST).write_bytes(data)


def _load(directory: Path, raw, outcomes: Counter) -> None:
    """parse_manifest on the decoded value; if it parses, Store on the same manifest written to disk.

    A refused value is not written: JSON round-trips these values exactly, so Store would refuse it in
    parse_manifest the same way, and skipping the file write and the path lookups keeps 10,000 examples
    fast. Store adds the checks of the files themselves (present, long enough, a name the filesystem takes).
    """
    try:
        manifest = parse_manifest(directory, raw)
    except StoreError:
        outcomes["parse refused"] += 1
        return
    outcomes["parsed"] += 1
    _assert_sound(directory, manifest)
    # allow_nan: the converter's json.dump writes NaN and Infinity too, so the reader must cope with them.
    _write_manifest(directory, json.dumps(raw).encode())
    _open(directory, outcomes)


def _open(directory: Path, outcomes: Counter) -> None:
    try:
        store = Store(directory)
    except StoreError:
        outcomes["store refused"] += 1
    else:
        outcomes["store opened"] += 1
        _assert_sound(directory, store.manifest)


def test_pristine_manifests_load(seeds):
    for store in seeds.values():
        _assert_sound(store, parse_manifest(store, json.loads((store / MANIFEST).read_text())))
        _assert_sound(store, Store(store).manifest)


@pytest.mark.parametrize("seed", ["float", "quantized"])
def test_mutated_manifests_load_or_raise_store_error(seeds, scratch, seed):
    text = (seeds[seed] / MANIFEST).read_text()
    outcomes = Counter()

    @settings(max_examples=2000, **FUZZ)
    @given(mutated(text))
    def run(raw):
        _load(scratch[seed], raw, outcomes)

    run()
    # Not vacuous: many mutations (in model_config, source, created_by, a valid path) still load, and
    # many are refused; a broken fixture would make every example fail the same way.
    assert outcomes["parsed"] > 50 and outcomes["parse refused"] > 500, outcomes
    assert outcomes["store opened"] > 50, outcomes


def test_arbitrary_json_documents_load_or_raise_store_error(scratch):
    scratch = scratch["float"]
    outcomes = Counter()

    @settings(max_examples=1000, **FUZZ)
    @given(json_values)
    def run(raw):
        _load(scratch, raw, outcomes)

    run()


def _edit(data: bytes, pos: int, kind: str, token: bytes) -> bytes:
    pos %= len(data) + 1
    if kind == "insert":
        return data[:pos] + token + data[pos:]
    if kind == "replace":
        return data[:pos] + token + data[pos + len(token) :]
    if kind == "truncate":
        return data[:pos]
    return data[:pos] + data[pos + 1 :]  # delete one byte


# Tokens that break a JSON decoder in ways other than a syntax error: nesting deeper than the recursion
# limit, integers longer than Python's int/str conversion limit, non-finite numbers, escaped NUL and
# lone surrogates, bytes that are not UTF-8; and ordinary tokens that shift a structure.
JSON_TOKENS = [
    b"[" * 100_000,
    b'{"a":' * 50_000,
    b"1" * 5000,
    b"-" + b"9" * 4301,
    b"NaN",
    b"-Infinity",
    b"1e999",
    b'"\\u0000"',
    b'"\\ud800"',
    b"\xff",
    b"\xc3",
    b"\x00",
    b"}",
    b"]",
    b",",
    b'"',
    b"null",
    b"true",
    b"0",
    b"4096",
    b"-1",
    b'"../../etc/passwd"',
]
EDIT_KINDS = st.sampled_from(["insert", "replace", "truncate", "delete"])
TOKENS = st.one_of(st.sampled_from(JSON_TOKENS), st.binary(max_size=4))
SMALL_BINARY = st.binary(max_size=200)


@st.composite
def manifest_bytes(draw, data: bytes):
    """Raw manifest.json contents: arbitrary bytes, or the real manifest's bytes with one to three edits."""
    if draw(st.booleans()):
        return draw(SMALL_BINARY)
    for _ in range(draw(MUTATIONS)):
        data = _edit(data, draw(ANY_INDEX), draw(EDIT_KINDS), draw(TOKENS))
    return data


def test_raw_bytes_load_or_raise_store_error(pristine, scratch):
    store, _ = pristine
    scratch = scratch["float"]
    outcomes = Counter()

    @settings(max_examples=5000, **FUZZ)
    @given(manifest_bytes((store / MANIFEST).read_bytes()))
    @example(b"[" * 100_000)  # nested deeper than the recursion limit: RecursionError from json.loads
    @example(b'{"a": ' + b"1" * 5000 + b"}")  # ValueError: an integer longer than Python's 4300-digit limit
    @example(b"\xff\xfe")  # not UTF-8
    @example(b"")
    def run(data):
        _write_manifest(scratch, data)
        _open(scratch, outcomes)

    run()
    assert outcomes["store refused"] > 1000, outcomes


@pytest.mark.parametrize(
    "path",
    ["a\x00b", "\ud800", "loop", "a" * 300, ("a" * 200 + "/") * 40, "../" + "a" * 300],
    ids=["nul", "surrogate", "symlink-loop", "long-name", "long-path", "escape-long-name"],
)
@pytest.mark.parametrize("field", ["resident", "layer", "extra"])
def test_paths_the_filesystem_cannot_look_up(pristine, tmp_path, path, field):
    """NUL, characters no filesystem encoding takes, symlink loops, names past NAME_MAX and PATH_MAX make
    Path.resolve, is_file or stat raise ValueError, RuntimeError or OSError; the reader says StoreError."""
    store = tmp_path / "store"
    shutil.copytree(pristine[0], store)
    (store / "loop").symlink_to("loop")
    raw = json.loads((store / MANIFEST).read_text())
    if field == "resident":
        raw["resident"]["files"][0]["path"] = path
    elif field == "layer":
        raw["experts"]["layers"][0]["file"] = path
    else:
        raw["extra_files"].append(path)
    if path in ("a\x00b", "\ud800", "loop"):  # cannot be resolved at all
        with pytest.raises(StoreError, match="cannot be looked up.*convert it again"):
            parse_manifest(store, raw)
    else:
        try:
            _assert_sound(store, parse_manifest(store, raw))
        except StoreError as e:
            assert "convert it again" in str(e)
    _write_manifest(store, json.dumps(raw).encode())
    if field == "extra":  # Store checks the data files only; the tokenizer loader reports a bad extra file
        try:
            _assert_sound(store, Store(store).manifest)
        except StoreError as e:
            assert "convert it again" in str(e)
    else:
        with pytest.raises(StoreError, match="convert it again"):
            Store(store)


# (path in the quantized seed's manifest, a value equal to the right one under == but not an int)
NOT_INTS = [
    (("experts", "layers", 0, "quantization", "group_size"), 32.0),  # accepted before: the int4 kernel then raised TypeError
    (("experts", "layers", 0, "index"), False),
    (("experts", "layers", 0, "offsets", 1), 4096.0),
    (("experts", "layers", 0, "tensors", 0, "shape", 0), 64.0),
    (("experts", "layers", 0, "tensors", 1, "offset"), 1024.0),
    (("experts", "layers", 0, "record_bytes"), 2048.0),
    (("resident", "files", 0, "size"), 1.0e3),
    (("format_version",), 2.0),
]


@pytest.mark.parametrize("path,value", NOT_INTS, ids=[".".join(map(str, p)) for p, _ in NOT_INTS])
def test_numbers_must_be_ints(seeds, path, value):
    """32.0 == 32 and False == 0 in Python, so a membership or equality check alone lets them through."""
    raw = json.loads((seeds["quantized"] / MANIFEST).read_text())
    _parent(raw, path)[path[-1]] = value
    with pytest.raises(StoreError):
        parse_manifest(seeds["quantized"], raw)
