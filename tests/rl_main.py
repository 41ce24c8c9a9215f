"""train_rl.main as a process, with settings of train_rl.FIXED that a test fixes (a JSON object as the
first argument), for the tests that run RL in processes of its own (torchrun):

    python tests/rl_main.py '{"canary_every": 0}' --preset smoke --init-from CKPT --out-dir DIR"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_rl  # noqa: E402

if __name__ == "__main__":
    train_rl.main(sys.argv[2:], **json.loads(sys.argv[1]))
