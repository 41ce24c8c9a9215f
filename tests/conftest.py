# Make the flat top-level scripts (model.py, env.py, ...) importable from tests/.
import os
import sys

import pytest
from sandbox import SandboxPool

# OpenMP threads that spin while waiting steal the CPU from the sandbox's processes on a small
# machine; the scripts set this too, but it only counts if it is set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def pool():
    """A sandbox pool per test module (a module may define its own, e.g. with another timeout)."""
    with SandboxPool(workers=2, timeout_s=2.0) as p:
        yield p
