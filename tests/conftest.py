import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two-core CI machines: keep torch from oversubscribing while I/O threads run.
    torch.set_num_threads(2)
    yield


@pytest.fixture(autouse=True)
def _float_activations_unless_asked():
    # Most tests compare streamed models with transformers' own forward on the same weights, to float
    # rounding. The int8-activation kernels round each activation to 8 bits (as llama.cpp does), so load()
    # takes float activations here unless a test passes activations= (tests/test_int8_activations.py does,
    # against the float64 reference of exactly that arithmetic and against the float path).
    from moestream.core.compute import plan

    plan.DEFAULT_ACTIVATIONS = "float"
    yield
    plan.DEFAULT_ACTIVATIONS = "auto"


@pytest.fixture(scope="session", autouse=True)
def _fused_kernels_built():
    # On a fresh machine the first load compiles core/compute/fused.py's kernels (about 30 s of one core): do it here, once,
    # rather than inside whichever test (or CLI subprocess under a timeout) loads a model first.
    from moestream.native import fused_build

    fused_build.extension()
    yield


@pytest.fixture(scope="session", autouse=True)
def _kv_tier_in_a_temporary_directory():
    # `serve` and `chat` keep a KV tier on disk by default (--kv-disk auto, under the user's cache): the tests'
    # servers and chats, in this process or its subprocesses, keep theirs in a directory of the session's.
    with tempfile.TemporaryDirectory(prefix="moestream-kv-") as directory:
        os.environ["MOESTREAM_KV_DISK"] = directory
        yield
        os.environ.pop("MOESTREAM_KV_DISK", None)
