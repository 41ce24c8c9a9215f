"""lab/experiments/report.py: the markdown table (and the Finding-1 scatter) of one experiment directory.

    python -m lab.experiments.report runs/exp/cpt_budget --title "Finding 1" --scatter
    python -m lab.experiments.report runs/exp/router_replay --title "Router replay" --curve logp_mismatch
    python -m lab.experiments.report runs/exp/memory_cpu --memory     # lab/experiments/memory.sh's table
    python -m lab.experiments.report runs/agent-cpu/eval/episodes-0 --seeds runs/agent-cpu/eval/episodes-1 \
        runs/agent-cpu/eval_s1/episodes-0      # the agent's two RL seeds against the boot (docs/agent.md)

An experiment script (lab/experiments/*.sh, through lab/experiments/lib.sh's run_stage) leaves one JSON summary per
stage in its directory: pretrain_<run>.json and rl_<run>.json, where <run> is <config>_s<seed>. This script
reads them (and the RL runs' metrics.jsonl for per-step means), writes results.md with one row per run and one
mean row per config (so the seed-to-seed noise is in the table next to the effect), and with --scatter draws
Finding 1: final validation loss (x) against held-out pass@1 on the near and novel slices before and after
RL (y). --memory: memory.sh's table (memory.md) and figure (memory.png) from its eval directory (agent.json
and the episodes beside it) and its RL runs. Ends with one JSON line.
"""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra.cli import ArgumentParser, die  # noqa: E402  (bad input: one line `error: ...`, exit code 2)
from lab.plot import plt, read_metrics  # noqa: E402  (matplotlib, files only; the metrics.jsonl reader)

PRE_KEYS = [("params_active", "active params"), ("params_total", "total params"), ("tokens", "pretrain tokens"), ("val_loss", "val loss"), ("val_bpb", "val bits/byte")]
RL_KEYS = [("pass@1_{}", "pass@1 all"), ("pass@1_near_{}", "pass@1 near"), ("pass@1_novel_{}", "pass@1 novel"),
           ("pass@8_novel_{}", "pass@8 novel")]


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        die(f"{path}: not a stage summary ({e})")


def metrics_mean(summary, key):
    """Mean of one per-step key over an RL run's metrics.jsonl (e.g. logp_mismatch, clip_frac)."""
    path = summary.get("metrics", "")
    records = read_metrics(path) if os.path.isfile(path) else []
    vals = [v for r in records if isinstance(v := r.get(key), (int, float))]
    return statistics.fmean(vals) if vals else None


def collect(out_dir, curves):
    """{run: {column: value}} from the stage summaries in out_dir."""
    runs = {}
    natural = lambda path: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]   # b4 before b12
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json")), key=natural):
        m = re.fullmatch(r"(pretrain|rl)_(.+)\.json", os.path.basename(path))
        if not m:
            continue
        kind, run = m.groups()
        s, row = load_json(path), runs.setdefault(m.group(2), {})
        if kind == "pretrain":
            row.update({col: s.get(key) for key, col in PRE_KEYS})
        else:
            k = next((m.group(1) for key in s if (m := re.fullmatch(r"pass@(\d+)_novel_before", key))
                      and m.group(1) != "1"), "8")    # the run's --eval-k
            for key, col in RL_KEYS:
                key, col = key.replace("@8", f"@{k}"), col.replace("@8", f"@{k}")
                row[f"{col} before"], row[f"{col} after"] = s.get(key.format("before")), s.get(key.format("after"))
            row["RL steps"] = s.get("steps")
            for key in curves:
                row[f"mean {key}"] = metrics_mean(s, key)
    if not runs:
        die(f"{out_dir}: no pretrain_<run>.json or rl_<run>.json stage summaries")
    return runs


def with_means(runs):
    """Rows in order, then one 'config (mean of n seeds)' row per config that ran with more than one seed."""
    rows = dict(runs)
    configs = {}
    for run in runs:
        configs.setdefault(re.sub(r"_s\d+$", "", run), []).append(run)
    for config, members in configs.items():
        if len(members) < 2:
            continue
        cols = {c for r in members for c in runs[r]}
        rows[f"{config} (mean of {len(members)})"] = {
            c: statistics.fmean(v) if (v := [runs[r][c] for r in members if isinstance(runs[r].get(c), (int, float))])
            else None for c in cols}
    return rows


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float) and 0 < abs(v) < 1e-3:   # e.g. a mean log-prob mismatch of 4e-4
        return f"{v:.1e}"
    if isinstance(v, float) and abs(v) < 100:
        return f"{v:.3f}"
    return f"{v:,.0f}" if isinstance(v, (int, float)) else str(v)


def markdown(rows, title):
    cols = []
    for row in rows.values():
        cols += [c for c in row if c not in cols]
    lines = [f"## {title}", "", "| run | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += ["| " + " | ".join([run] + [fmt(row.get(c)) for c in cols]) + " |" for run, row in rows.items()]
    return "\n".join(lines) + "\n"


def scatter(runs, path):
    """Finding 1: lower loss after continued pretraining -> higher reward after the same RL run?"""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, (sl, marker) in enumerate((("near", "o"), ("novel", "s"))):
        for when, fill in (("before", "none"), ("after", f"C{i}")):
            pts = sorted((r["val loss"], r[f"pass@1 {sl} {when}"]) for r in runs.values()
                         if r.get("val loss") is not None and r.get(f"pass@1 {sl} {when}") is not None)
            if pts:
                ax.plot(*zip(*pts), marker=marker, ls="-" if when == "after" else ":", color=f"C{i}",
                        mfc=fill, label=f"{sl}, {when} RL")
    ax.set(xlabel="validation loss after continued pretraining (nats/token)", ylabel="held-out pass@1",
           title="Finding 1: pretraining loss vs RL result")
    ax.invert_xaxis()   # better pretraining to the right
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


MEMORIES = ("summary", "mask", "window")     # train_rl.py --memory; eval.py adds oracle_summary


def memory_report(out_dir):
    """memory.sh's comparison: each RL run (rl_<memory>_s<seed>) and the boot on the long tasks under its
    own memory, the oracle summary, and the others' memories; the mean of the seeds per memory; and the
    paired gains of summary over mask and window (each under its own memory, the seeds' episodes pooled
    per task, SE paired over tasks: eval.paired_gain)."""
    from eval import paired_gain
    path = os.path.join(out_dir, "eval", "agent.json")
    figs = load_json(path)["figures"]
    labels = list(figs)
    episodes = {}
    for i, label in enumerate(labels):
        for m in MEMORIES + ("oracle_summary",):
            f = os.path.join(out_dir, "eval", f"episodes-{i}-{m}.jsonl")
            if os.path.isfile(f):
                episodes[label, m] = [json.loads(line) for line in open(f)]
    rows, pooled = {}, {}
    for label in labels:
        m = label.split("_s")[0] if label != "boot" else "summary"
        g = figs[label]
        rl = load_json(os.path.join(out_dir, f"rl_{label}.json")) if label != "boot" else {}
        rows[label] = {"trained": label if label == "boot" else m, "own": g.get(f"{m}/pass@1"),
                       "own near": g.get(f"{m}/slice=near/pass@1"), "own novel": g.get(f"{m}/slice=novel/pass@1"),
                       **{f"under {k}": g.get(f"{k}/pass@1") for k in MEMORIES + ("oracle_summary",)},
                       "retention (summary)": g.get("summary/fact_retention"), "contexts/ep": g.get(f"{m}/per_episode"),
                       "over_cap": g.get(f"{m}/over_cap"), "step_limit": g.get(f"{m}/step_limit"),
                       "RL steps": rl.get("steps")}
        if label != "boot":
            pooled.setdefault(m, []).extend(episodes.get((label, m), []))
            pooled.setdefault(f"{m}@oracle", []).extend(episodes.get((label, "oracle_summary"), []))
    means = {}
    for m in MEMORIES:
        members = [r for r in rows.values() if r["trained"] == m]
        if len(members) > 1:
            means[f"{m} (mean of {len(members)})"] = {
                c: statistics.fmean(v) if (v := [r[c] for r in members if isinstance(r[c], (int, float))]) else None
                for c in members[0] if c != "trained"}
    rows.update(means)
    tasks = {r["task_id"]: r.get("slice", "") for recs in pooled.values() for r in recs}
    tasks = [type("T", (), {"task_id": t, "slice": sl}) for t, sl in tasks.items()]
    gains = {}
    for base, name in (("mask", "mask"), ("window", "window"), ("summary@oracle", "oracle_summary")):
        if pooled.get("summary") and pooled.get(base):
            for sl, (gain, se) in paired_gain(tasks, pooled[base], pooled["summary"]).items():
                gains[f"summary - {name}, {sl.split('=')[-1].rstrip('/') or 'all'}"] = \
                    f"{gain:+.3f} (paired SE {se:.3f})"
    own, top = (statistics.fmean(r["passed"] for r in pooled.get(k) or [{"passed": 0}])
                for k in ("summary", "summary@oracle"))
    if top:
        gains["summary / oracle_summary, all"] = f"{own / top:.2f}"
    lines = [markdown(rows, "Memory: long tasks, each trained method under its own memory and the others'"), ""]
    lines += ["| gain (mean of the seeds, paired over tasks) | pass@1 |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in gains.items()]
    return "\n".join(lines) + "\n", rows, gains


def memory_figure(rows, path):
    """pass@1 on long tasks: each trained memory (mean of its seeds) under each memory at eval."""
    names = [n for n in rows if "mean of" in n] or [n for n in rows if n != "boot"]
    evals = [f"under {k}" for k in MEMORIES + ("oracle_summary",)]
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(evals)
    for j, col in enumerate(evals):
        ax.bar([i + j * w for i in range(len(names))], [rows[n][col] or 0 for n in names], w, label=col)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))], [n.split(" (")[0] for n in names])
    ax.set(xlabel="trained with --memory", ylabel="pass@1, long tasks (held out)",
           title="Memory: trained as much as each other, measured under each")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SUITES = ("agent", "no_run", "oracle", "located", "search")


def seeds_report(base, runs):
    """eval.py --agent's episodes of one checkpoint (`base`, an episodes prefix such as
    runs/agent-cpu/eval/episodes-0) against RL runs from it (one prefix each, e.g. two RL seeds): each
    suite's gain over base, the runs' episodes pooled per task (eval.paired_gain), overall, per slice,
    per kind and on the bug kinds; and the runs' agent against each baseline, both pooled."""
    from eval import SLICES, paired_gain, _by_task
    recs = {(p, s): [json.loads(line) for line in open(f"{p}-{s}.jsonl")]
            for p in [base] + runs for s in SUITES if os.path.isfile(f"{p}-{s}.jsonl")}
    for p in [base] + runs:
        if not any((p, s) in recs for s in SUITES):
            die(f"{p}: no eval.py --agent episodes there ({p}-agent.jsonl, ...)")
    pool = lambda s: [r for p in runs for r in recs[p, s]]
    tasks = {r["task_id"]: type("T", (), {"task_id": r["task_id"], "slice": r.get("slice", ""),
                                          "kind": r.get("kind", "")}) for rs in recs.values() for r in rs}
    tasks = list(tasks.values())
    groups = {"all": SLICES[""], "bugs": lambda t: t.kind in ("bug", "two_bugs"),
              **{k.strip("/"): keep for k, keep in SLICES.items() if k},
              **{f"kind={k}": (lambda k: lambda t: t.kind == k)(k) for k in sorted({t.kind for t in tasks})}}

    def rows(first, base_recs, other_recs):
        rate = lambda rs: {t: sum(r["passed"] for r in g) / len(g) for t, g in _by_task(rs).items()}
        a, b = rate(base_recs), rate(other_recs)
        for g, (gain, se) in paired_gain(tasks, base_recs, other_recs, groups).items():
            ts = [t.task_id for t in tasks if t.task_id in a and t.task_id in b and groups[g](t)]
            yield (f"| {first}{g} | {statistics.fmean(a[t] for t in ts):.3f} | "
                   f"{statistics.fmean(b[t] for t in ts):.3f} | {100 * gain:+.1f} ({100 * se:.1f}) |")
    lines = [f"| suite, tasks | {base} | mean of {len(runs)} runs | gain (paired SE) |", "|---|---|---|---|"]
    for s in SUITES:
        if all((p, s) in recs for p in [base] + runs):
            lines += rows(f"{s}, ", recs[base, s], pool(s))
    lines += ["", "| the runs' agent against | tasks | baseline | agent | agent - baseline (paired SE) |",
              "|---|---|---|---|---|"]
    for s in SUITES[1:]:
        if all((p, x) in recs for p in runs for x in ("agent", s)):
            lines += rows(f"{s} | ", pool(s), pool("agent"))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = ArgumentParser(prog="report.py", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="an experiment's output directory (holds the stage summaries)")
    p.add_argument("--title", default="results")
    p.add_argument("--curve", action="append", default=[], help="per-step RL metric to average into a column")
    p.add_argument("--scatter", action="store_true", help="draw finding1.png (val loss vs pass@1 per slice)")
    p.add_argument("--memory", action="store_true", help="memory.sh's table and figure (memory.md, memory.png)")
    p.add_argument("--seeds", nargs="+", metavar="PREFIX", help="eval.py --agent episodes of RL runs (e.g. two "
                   "seeds: DIR/eval/episodes-1 DIR/eval_s1/episodes-0) against the checkpoint whose prefix is "
                   "out_dir (DIR/eval/episodes-0): seeds.md beside it")
    args = p.parse_args(argv)
    if args.seeds:
        text = seeds_report(args.out_dir, args.seeds)
        out = {"table": os.path.join(os.path.dirname(args.out_dir), "seeds.md"), "runs": len(args.seeds)}
    elif args.memory:
        text, rows, gains = memory_report(args.out_dir)
        out = {"table": os.path.join(args.out_dir, "memory.md"), "figure": os.path.join(args.out_dir, "memory.png"),
               "gains": gains}
        memory_figure(rows, out["figure"])
    else:
        runs = collect(args.out_dir, args.curve)
        text = markdown(with_means(runs), args.title)
        out = {"table": os.path.join(args.out_dir, "results.md"), "runs": len(runs)}
        if args.scatter:
            out["scatter"] = os.path.join(args.out_dir, "finding1.png")
            scatter(runs, out["scatter"])
    with open(out["table"], "w") as f:
        f.write(text)
    print(text)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
