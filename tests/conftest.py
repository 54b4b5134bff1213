import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Two-core CI machines: keep torch from oversubscribing while I/O threads run.
    torch.set_num_threads(2)
    yield
