# Make the flat top-level scripts (model.py, env.py, ...) importable from tests/.
import os
import sys

# OpenMP threads that spin while waiting steal the CPU from the sandbox's processes on a small
# machine; the scripts set this too, but it only counts if it is set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
