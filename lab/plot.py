"""lab/plot.py: figures from the metrics.jsonl that every run writes (pretraining and RL), several runs overlaid.

    python -m lab.plot runs/cpu --out-dir runs/cpu/figures              # a run.sh directory (pretrain/ + rl/)
    python -m lab.plot runs/a/rl runs/b/rl --label a --label b --out-dir figs
    python -m lab.plot runs/cpu/pretrain --out-dir figs --prefix cpu_   # file names cpu_pretrain.png, ...

Writes up to three PNG files into --out-dir:
  pretrain.png  training loss and validation bits-per-byte over tokens seen
  rl.png        reward, train pass rate, held-out pass@1 and pass@k per slice, entropy, zero-variance
                fraction and completion length over RL steps
  rl_time.png   where the RL wall clock went (generation / sandbox / training / held-out evals)
and prints one JSON line naming them. Only this script imports matplotlib; the trainers never need it.
"""
import argparse
import contextlib
import json
import os
import re

import matplotlib
matplotlib.use("Agg")  # files only, no display: the same on a laptop, a server and CI
import matplotlib.pyplot as plt

from infra.cli import ArgumentParser, die   # bad input: one line `error: ...`, exit code 2 (no torch)


def read_metrics(path):
    """The JSON records of one metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def find_runs(dirs, labels):
    """[(kind, label, records)] for each directory: a run directory holding metrics.jsonl, or a run.sh
    directory whose pretrain/ and rl/ subdirectories hold one each. kind is 'pretrain' or 'rl'."""
    if labels and len(labels) != len(dirs):
        die(f"got {len(labels)} --label for {len(dirs)} run directories: give one each, or none")
    runs = []
    for i, d in enumerate(dirs):
        label = labels[i] if labels else os.path.basename(os.path.normpath(d))
        found = [d] if os.path.isfile(os.path.join(d, "metrics.jsonl")) else \
            [os.path.join(d, s) for s in ("pretrain", "rl") if os.path.isfile(os.path.join(d, s, "metrics.jsonl"))]
        if not found:
            die(f"{d}: no metrics.jsonl in it nor in its pretrain/ or rl/ subdirectory")
        for run_dir in found:
            records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
            # RL steps log a reward; pretraining steps log tokens seen.
            kind = "rl" if any("reward" in r or "eval" in r for r in records) else "pretrain"
            runs.append((kind, label, records))
    return runs


def series(records, key, x="step"):
    """(xs, ys) of the records that have both keys, in the order written."""
    pts = [(r[x], r[key]) for r in records if x in r and isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_pretrain(runs):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, recs in runs:
        steps = [r for r in recs if "eval" not in r]
        axes[0].plot(*series(steps, "loss", "tokens"), label=label, lw=1)
        axes[1].plot(*series(steps, "val_bpb", "tokens"), "o-", label=label, ms=3)
    for ax, title in zip(axes, ("training loss (nats/token)", "validation bits per byte")):
        ax.set(xlabel="tokens seen", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def eval_keys(recs):
    """The held-out score keys the RL evals logged, e.g. pass@1, pass@8, pass@1_novel, pass@8_near."""
    return sorted({k for r in recs if "eval" in r for k in r if re.fullmatch(r"pass@\d+(_\w+)?", k)})


def plot_rl(runs):
    panels = [("reward", "reward (mean over samples)"), ("pass_rate", "train pass rate"),
              ("entropy", "token entropy (nats)"), ("zero_var_frac", "zero-variance group fraction"),
              ("len_mean", "completion length (tokens)")]
    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    axes = axes.ravel()
    styles = {"": "-", "near": "--", "novel": ":"}   # one colour per run, one line style per held-out slice
    for i, (label, recs) in enumerate(runs):
        steps = [r for r in recs if "eval" not in r]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(*series(steps, key), color=f"C{i}", label=label, lw=1)
        evals = [r for r in recs if "eval" in r]
        for key in eval_keys(recs):
            k, _, slice_name = key.partition("_")
            ax = axes[5] if k == "pass@1" else axes[6]
            ax.plot(*series(evals, key), marker="o", ls=styles.get(slice_name, "-."), color=f"C{i}", ms=3,
                    label=f"{label} {k} {slice_name or 'all'}")
    for ax, (_, title) in zip(axes, panels + [(None, "held-out pass@1 by slice"), (None, "held-out pass@k by slice")]):
        ax.set(xlabel="RL step", title=title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[7].axis("off")
    return fig


def plot_rl_time(runs):
    parts = [("gen_s", "generation"), ("sandbox_s", "sandbox"), ("train_s", "training"), ("eval_s", "held-out evals")]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(runs), 3.8))
    for i, (label, recs) in enumerate(runs):
        bottom = 0.0
        for j, (key, name) in enumerate(parts):
            total = sum(r.get(key, 0.0) for r in recs if isinstance(r.get(key), (int, float)))
            ax.bar(i, total, bottom=bottom, color=f"C{j}", label=name if i == 0 else None)
            bottom += total
    ax.set_xticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
    ax.set(ylabel="seconds", title="RL wall clock")
    ax.legend(fontsize=8)
    return fig


def main(argv=None):
    p = ArgumentParser(prog="lab/plot.py", description=__doc__.split("\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl, or run.sh's pretrain/ and rl/)")
    p.add_argument("--label", action="append", default=[], help="legend label per run directory (default: its name)")
    p.add_argument("--out-dir", required=True, help="where the PNG files go")
    p.add_argument("--prefix", default="", help="prepended to each file name")
    args = p.parse_args(argv)
    runs = find_runs(args.runs, args.label)
    os.makedirs(args.out_dir, exist_ok=True)
    figures = []
    for kind, fn, name in (("pretrain", plot_pretrain, "pretrain.png"), ("rl", plot_rl, "rl.png"),
                           ("rl", plot_rl_time, "rl_time.png")):
        chosen = [(label, recs) for k, label, recs in runs if k == kind]
        if chosen:
            figures.append(os.path.join(args.out_dir, args.prefix + name))
            fig = fn(chosen)
            fig.tight_layout()
            fig.savefig(figures[-1], dpi=110)
            plt.close(fig)
    print(json.dumps({"figures": figures, "runs": len(runs)}))


if __name__ == "__main__":
    main()
