"""
The command-line convention every script shares, in a module without torch: lab/plot.py, env.py,
data/*.py and lab/experiments/report.py import it without loading torch, and infra/common.py re-exports
both names (common.die, common.ArgumentParser).

Bad input is one line on stderr, `error: ...`, and exit code 2, whether a script's own check finds
it (die) or argparse does (ArgumentParser: an unknown flag, a bad value, a missing argument).
"""
import argparse
import sys


def die(msg):
    """A clear one-line error and exit code 2 (the convention for bad input in every script)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are die's one line, without the usage block in front (--help
    prints that). The parsers of add_subparsers are of this class too (argparse's default)."""

    def error(self, message):
        die(message)
