"""House style: no line longer than 110 characters in the files a reader reads (the recipe, the sandbox,
the RL step's pieces, the plumbing; data tables and the lab annex are left out). Reads the files as text,
imports nothing of the project.
python -m pytest tests/test_style.py -q"""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 110


def checked_files():
    """The recipe and the sandbox (the top level), the RL step's pieces (rl/), the plumbing (infra/)."""
    found = [p for d in ("", "rl", "infra") for p in glob.glob(os.path.join(ROOT, d, "*.py"))]
    return sorted(os.path.relpath(p, ROOT) for p in found)


def test_lines_are_at_most_110_characters():
    files = checked_files()
    assert {"model.py", "sandbox.py", "rl/algo.py", "infra/common.py"} <= set(files)
    long = []
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if len(line.rstrip("\n")) > MAX_LEN:
                    long.append(f"{path}:{n}: {len(line.rstrip(chr(10)))} characters")
    assert not long, f"lines over {MAX_LEN} characters (wrap them):\n" + "\n".join(long)
