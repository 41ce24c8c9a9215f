"""House style: no line longer than 110 characters in the files a reader reads (the reading path and
its speed paths). Reads the files as text, imports nothing of the project.
python -m pytest tests/test_style.py -q"""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 110
FILES = ["model.py", "train_pretrain.py", "train_mtp.py", "train_rl.py", "env.py", "eval.py", "agent.py",
         "infra/engine.py", "infra/fast.py", "infra/speculative.py"]


def checked_files():
    rl = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "rl", "*.py")))
    return FILES + rl


def test_lines_are_at_most_110_characters():
    files = checked_files()
    assert len(files) > len(FILES), "rl/*.py found"
    long = []
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if len(line.rstrip("\n")) > MAX_LEN:
                    long.append(f"{path}:{n}: {len(line.rstrip(chr(10)))} characters")
    assert not long, f"lines over {MAX_LEN} characters (wrap them):\n" + "\n".join(long)
