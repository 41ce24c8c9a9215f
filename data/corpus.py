"""
The pretraining corpus of train_pretrain.py: sources -> dedupe -> held-out filter -> train/val
split -> (tokenizer) -> memmapped token caches; and bits-per-byte, the one definition that
pretraining's validation and eval.py both report.

    user_data, mix = corpus.parse_sources(["code=~/src/repo"], "stdlib=0.3,tasks=0.5,code=0.2")
    prep = corpus.prepare(args, mix, user_data, tok=None, cache_dir="runs/x/cache")   # rank 0
    arrays = corpus.open_caches(prep)           # {"stdlib/train": memmap, "stdlib/val": ..., ...}
    x, y = corpus.inputs_targets(windows, vocab_size)
    bpb = corpus.to_bits_per_byte(*corpus.nats_and_bytes(model, tok, corpus.heldout_code_texts()))

Each source is a lazy stream of documents, ordered and split by hashes of their path / content, so
the corpus, its split and the caches are deterministic and need no stored file lists. `args` is
train_pretrain.py's namespace (the flags of its data section: --text-field, --max-file-kb,
--data-ext, --source-mb, --tasks-n, --repair-frac, --holdout-n, --val-frac, --tok-train-mb,
--vocab-size, --seed).
"""
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from infra import common
from model import autocast
import tokenizer
from tokenizer import Tokenizer, train_tokenizer

BUILT_IN = ("stdlib", "tasks", "agent")


def parse_sources(specs, mix_spec):
    """--data [NAME=]PATH (repeatable) and --mix NAME=W,... -> ({name: path}, {name: weight > 0}).
    Unnamed sources are data, data2, data3, ...; every --data source needs a weight."""
    user_data = {}
    for spec in specs:
        unnamed = sum(n == "data" or re.fullmatch(r"data\d+", n) is not None for n in user_data)
        name, _, path = spec.partition("=") if re.match(r"^\w+=", spec) else (f"data{unnamed + 1 if unnamed else ''}", "", spec)
        path = os.path.expanduser(path)
        if name in (*BUILT_IN, *user_data):
            common.die(f"--data {spec!r}: source name {name!r} is already taken")
        if not os.path.exists(path):
            common.die(f"--data {spec!r}: no such file or directory {path!r}")
        user_data[name] = path
    mix = parse_mix(mix_spec, [*BUILT_IN, *user_data])
    for name in user_data:
        if mix.get(name, 0) <= 0:
            common.die(f"--data source {name!r} has no weight in --mix (e.g. --mix {mix_spec},{name}=0.3)")
    mix = {n: w for n, w in mix.items() if w > 0}
    if not mix:
        common.die("--mix: all weights are zero")
    return user_data, mix


def parse_mix(mix_spec, known):
    """--mix NAME=W,... -> {name: weight} (zeros kept); a one-line error for a malformed entry, a name
    not in `known`, or a weight that is not a finite number >= 0."""
    mix = {}
    for part in filter(None, mix_spec.split(",")):
        name, _, w = (x.strip() for x in part.partition("="))
        try:
            mix[name] = float(w)
        except ValueError:
            common.die(f"--mix: bad entry {part!r} (want NAME=WEIGHT)")
        if name not in known:
            common.die(f"--mix: unknown source {name!r} (known: {', '.join(known)})")
        if not 0 <= mix[name] < math.inf:
            common.die(f"--mix: the weight of {name!r} must be a finite number >= 0")
    return mix


# ---------------------------------------------------------------------------------------------
# The train/validation split, by content hash: split_sources splits with it and heldout_code_texts
# finds the same held-out stdlib documents with it for eval.py's bits-per-byte.

def doc_hash(text):
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def is_validation(h, val_frac):
    """A document (by its doc_hash) is validation when the hash's first 32 bits fall below val_frac."""
    return int(h[:8], 16) < val_frac * 16 ** 8


# ---------------------------------------------------------------------------------------------
# Reading code from disk: one reader, and one definition of the stdlib corpus, so that the files
# train_pretrain.py trains on and those eval.py scores as held out are selected alike.

def read_text_files(root, exts, skipped, skip_dir=lambda name: False, max_kb=1024):
    """Text files under a directory in path-hash order (an unbiased deterministic subsample when
    capped). Huge (> max_kb), binary (NUL bytes), non-UTF-8 and empty files are skipped and counted
    in the Counter `skipped`, not fatal. A generator: files past a cap are never read."""
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not skip_dir(x)]
        paths += [os.path.join(d, f) for f in files if os.path.splitext(f)[1] in exts]
    for path in sorted(paths, key=lambda q: doc_hash(os.path.relpath(q, root))):
        why = "huge" if os.path.getsize(path) > max_kb * 1e3 else None
        if not why:
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
                why = "binary" if "\0" in text else None if text.strip() else "empty"
            except UnicodeDecodeError:
                why = "binary" if b"\0" in raw else "non_utf8"
        if why:
            skipped[why] += 1
        else:
            yield text


def stdlib_docs(skipped, max_kb=1024):
    """The running interpreter's standard library *.py, without its tests, idlelib and site-packages."""
    skip = lambda d: d in ("site-packages", "idlelib") or d.startswith("test")
    return read_text_files(sysconfig.get_paths()["stdlib"], {".py"}, skipped, skip, max_kb)


# ---------------------------------------------------------------------------------------------
# Sources: lazy streams of documents

def capped(docs, mb):
    """Documents in order until `mb` MB of text (0 = all); lazy, so files past the cap are never read."""
    total = 0
    for d in docs:
        yield d
        total += len(d)
        if mb and total >= mb * 1e6:
            return


def read_jsonl(path, skipped, field="text", max_kb=1024):
    """Documents of a JSONL file (the string in `field`), in line-hash order; bad lines are counted."""
    with open(path, "rb") as f:
        lines = sorted((ln for ln in f.read().splitlines() if ln.strip()), key=lambda b: hashlib.sha256(b).digest())
    for line in lines:
        try:
            text = json.loads(line)[field]
            text.encode("utf-8")                     # a str without lone surrogates ("\ud800")
        except Exception:
            skipped["bad_json"] += 1
            continue
        why = "huge" if len(line) > max_kb * 1e3 else None if text.strip() else "empty"
        if why:
            skipped[why] += 1
        else:
            yield text


def load_source(name, path, skipped, args, generated=None):
    """One source's documents, capped at --source-mb. generated: {name: a function returning that
    source's documents}, for the generated sources (train_pretrain.py builds "tasks" from data/tasks.py
    and data/repair.py, "agent" from data/repos.py's oracle transcripts)."""
    if name == "stdlib":   # the running interpreter's stdlib (heldout_code_texts reads the same files)
        docs = stdlib_docs(skipped, args.max_file_kb)
    elif name in BUILT_IN:  # solved train-split tasks (and their repair transcripts), agent transcripts
        docs = generated[name]()
    elif os.path.isdir(path):
        exts = {"." + e.strip().lstrip(".") for e in args.data_ext.split(",")}
        docs = read_text_files(path, exts, skipped, max_kb=args.max_file_kb)
    else:
        docs = read_jsonl(path, skipped, args.text_field, args.max_file_kb)
    return capped(docs, args.source_mb)


# ---------------------------------------------------------------------------------------------
# Tokens: context-only ids (repair transcripts) and the caches

def encode_doc(tok, doc):
    """A transcript's ids, with its context stored as id + vocab_size: read by the model, never a
    target (inputs_targets). A repair transcript's context is its wrong attempt and feedback; its pieces
    (and a solved task's) between cuts (repair.Transcript: where the harness joins pieces encoded or
    sampled apart) are encoded apart, as the harness does. An agent transcript's (data/repos.py) context
    is its issue and observations, given as segments (text, context?, special?: a special token's name,
    marked as such, so that no text becomes a special token)."""
    if hasattr(doc, "segments"):
        ids = []
        for piece, context, special in doc.segments:
            part = [tok.specials[piece]] if special else tok.encode(piece)
            ids += [i + tok.vocab_size for i in part] if context else part
        return ids
    a, b = doc.context
    ids, cuts = [], sorted({0, a, b, len(doc), *getattr(doc, "cuts", ())})   # repair.Transcript's cuts
    for s, e in zip(cuts, cuts[1:]):
        part = tok.encode(doc[s:e])
        ids += [i + tok.vocab_size for i in part] if a <= s < b else part
    return ids


def inputs_targets(xy, vocab_size):
    """Windows of the token stream (..., T + 1) -> inputs and targets (..., T). An id >= vocab_size
    (encode_doc) is fed as its token but is no target (-1, ignored by the loss)."""
    return xy[..., :-1] % vocab_size, torch.where(xy[..., 1:] >= vocab_size, -1, xy[..., 1:])


def split_sources(args, mix, user_data, heldout, generated=None):
    """{name: (train, val)} lists of (hash, document): deduped, held-out documents dropped, split by
    content hash (--val-frac); and per source the counts of documents kept and skipped. heldout(doc)
    is the leak filter (data/tasks.py: is_heldout): what it flags never reaches training."""
    info, splits = {}, {}
    for name in mix:
        skipped, seen, train, val = Counter(), set(), [], []
        for doc in load_source(name, user_data.get(name), skipped, args, generated):
            h = doc_hash(doc)
            if h in seen or heldout(doc):
                skipped["duplicate" if h in seen else "heldout"] += 1
                continue
            seen.add(h)
            (val if is_validation(h, args.val_frac) else train).append((h, doc))
        if not train:
            common.die(f"source {name!r} ({user_data.get(name, name)}) has no usable documents "
                       f"(skipped: {dict(skipped) or 'none found'})")
        if not val and len(train) > 1:     # a tiny source: hold out its smallest-hash document
            val.append(train.pop(min(range(len(train)), key=lambda i: train[i][0])))
        splits[name] = (train, val)
        info[name] = {"docs": len(train) + len(val), "val_docs": len(val), "skipped": dict(skipped)}
        if acts := [d.actions for _, d in train + val if hasattr(d, "actions")]:   # agent transcripts
            info[name]["unpredictable_actions"] = sum(b for _, b in acts) / max(1, sum(n for n, _ in acts))
    return splits, info


def cached_tokenizer(args, splits, mix, cache_dir):
    """BPE on the train documents, each source's share by its mix weight; cached by corpus + code."""
    texts = [d for name, (train, _) in splits.items()
             for d in capped((d for _, d in train), args.tok_train_mb * mix[name] / sum(mix.values()))]
    with open(tokenizer.__file__) as f:   # keyed by the trainer's code too: a changed trainer retrains
        key = doc_hash(json.dumps([args.vocab_size, doc_hash(f.read()), [doc_hash(t) for t in texts]]))[:16]
    path = os.path.join(cache_dir, f"tokenizer-{key}.json")
    if os.path.isfile(path):
        return Tokenizer.load(path)
    t0 = time.time()
    tok = train_tokenizer(texts, args.vocab_size)
    tok.save(path)
    print(f"tokenizer: {tok.vocab_size} tokens, trained on {sum(map(len, texts)) / 1e6:.1f} MB "
          f"in {time.time() - t0:.1f}s", file=sys.stderr)
    return tok


def prepare(args, mix, user_data, tok, cache_dir, heldout, generated=None):
    """Load, dedupe, filter, split, (train the tokenizer if `tok` is None), tokenize into caches keyed
    by tokenizer + documents. Rank 0 only; the result (plain data) is broadcast to the others."""
    splits, info = split_sources(args, mix, user_data, heldout, generated)
    os.makedirs(cache_dir, exist_ok=True)
    if tok is None:
        tok = cached_tokenizer(args, splits, mix, cache_dir)
    dtype = np.uint16 if 2 * tok.vocab_size <= 2 ** 16 else np.uint32   # ids + vocab_size: see encode_doc
    paths = {}
    for name, parts in splits.items():
        for split, docs in zip(("train", "val"), parts):
            key = doc_hash(json.dumps([tok.fingerprint(), name, split, [h for h, _ in docs], "context-ids"]))[:16]
            path = paths[f"{name}/{split}"] = os.path.join(cache_dir, f"{name}-{split}-{key}.bin")
            if os.path.isfile(path):
                continue
            with common.atomic_open(path, "wb") as f:   # never half a cache
                for i in range(0, len(docs), 512):   # each document followed by end-of-text
                    part = [d for _, d in docs[i:i + 512]]
                    marked = [hasattr(d, "context") or hasattr(d, "segments") for d in part]   # transcripts
                    plain = tok.encode_batch(["" if m else d for d, m in zip(part, marked)])
                    for d, m, ids in zip(part, marked, plain):
                        if m:   # context marked, pieces encoded apart (encode_doc)
                            ids = encode_doc(tok, d)
                        np.asarray(ids + [tok.eot_id], dtype=dtype).tofile(f)
    return {"tokenizer": tok.to_dict(), "paths": paths, "info": info, "dtype": np.dtype(dtype).str}


def open_caches(prep):
    """{"NAME/train" | "NAME/val": read-only memmap of token ids} of a prepare() result."""
    return {k: np.memmap(path, dtype=prep["dtype"], mode="r") if os.path.getsize(path) else np.zeros(0, np.uint16)
            for k, path in prep["paths"].items()}


# ---------------------------------------------------------------------------------------------
# Bits per byte: cross-entropy per UTF-8 byte, not per token, so checkpoints with different
# tokenizers compare. One definition for train_pretrain.py's validation and eval.py.

def token_bytes(tok, device="cpu"):
    """UTF-8 bytes of every token id. End-of-text and pad count 0 bytes and are left out of the sum
    (as nanochat's evaluate_bpb does): the figure does not depend on how a tokenizer spells them."""
    nbytes = torch.tensor([len(tok.decode_bytes([i])) for i in range(tok.vocab_size)], device=device)
    nbytes[[tok.eot_id, tok.pad_id]] = 0
    return nbytes


def nats_and_bytes_of(nll, targets, nbytes):
    """(nats, bytes) of a batch: nll (N,) per target, targets (N,) ids (-1 = not scored), nbytes
    from token_bytes. Only targets with bytes count."""
    nb = torch.where(targets >= 0, nbytes[targets.clamp(min=0)], 0)
    return nll[nb > 0].sum().item(), nb.sum().item()


def to_bits_per_byte(nats, n_bytes):
    """The arithmetic: nats over n_bytes -> bits per byte (nats_and_bytes below scores a model)."""
    return nats / (math.log(2) * n_bytes)


def token_stream(tok, texts_or_tokens, limit=None):
    """Held-out documents (strings or lists of token ids) joined as [eot] doc1 [eot] doc2 ..., cut to
    its first `limit` tokens (None: all of them)."""
    stream = []
    for d in texts_or_tokens:
        stream += [tok.eot_id] + (tok.encode(d) if isinstance(d, str) else list(d))
        if limit is not None and len(stream) >= limit:
            return stream[:limit]
    return stream


@torch.no_grad()
def nats_and_bytes(model, tok, texts_or_tokens, max_tokens=None, batch_size=8):
    """(sum of -log p(token) in nats, UTF-8 bytes of those tokens) over held-out documents, joined
    as [eot] doc1 [eot] doc2 ... and cut into windows of seq_len that overlap by one token, so every
    document token is predicted exactly once. What is scored: nats_and_bytes_of (end-of-text
    and pad targets are not). Accepts strings or lists of token ids; max_tokens keeps a fixed prefix
    of the stream."""
    device = next(model.parameters()).device
    T = model.config.seq_len
    stream = token_stream(tok, texts_or_tokens, None if max_tokens is None else max_tokens + 1)
    nbytes = token_bytes(tok, device)
    starts = list(range(0, len(stream) - 1, T))
    nats, n_bytes, was_training = 0.0, 0, model.training
    model.eval()
    try:
        for b in range(0, len(starts), batch_size):
            xs, ys = [], []
            for s in starts[b:b + batch_size]:
                w = stream[s:s + T + 1]
                pad = T + 1 - len(w)
                xs.append(w[:-1] + [tok.pad_id] * pad)
                ys.append(w[1:] + [-1] * pad)
            x = torch.tensor(xs, device=device)
            y = torch.tensor(ys, device=device).view(-1)
            with autocast(device):
                logits, _ = model(x)
            nll = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.clamp(min=0), reduction="none")
            x_nats, x_bytes = nats_and_bytes_of(nll, y, nbytes)
            nats += x_nats
            n_bytes += x_bytes
    finally:
        model.train(was_training)
    return nats, n_bytes


@torch.no_grad()
def mtp_agreement(model, tok, texts_or_tokens, max_tokens=None, batch_size=8):
    """Each MTP level's top-1 agreement with the main head (model.py: MTP, train_mtp.py) over held-out
    documents, joined as nats_and_bytes joins them and cut into windows of seq_len: the share of slots
    whose level-m argmax is the main head's argmax there (slots m and on: before them a level reads
    zeros). At temperature 0 it is the share of drafts speculative decoding keeps (when the drafts
    before them were kept). Accepts strings or lists of token ids. Under model.autocast, as the
    drafting runs (bf16 on a GPU: the fused attention kernels and the MoE's sync-free dispatch)."""
    device, T = next(model.parameters()).device, model.config.seq_len
    stream = token_stream(tok, texts_or_tokens, max_tokens)
    n = max(1, len(stream) // T)
    x = torch.tensor(stream[:n * T] if len(stream) >= T else stream, device=device).view(n, -1)
    agree, was_training = torch.zeros(len(model.mtp), device=device), model.training
    model.eval()
    try:
        for i in range(0, n, batch_size):
            xb = x[i:i + batch_size]
            pos = torch.arange(xb.size(1), device=device)[None]
            with autocast(device):
                h, _ = model.trunk(xb, pos)
                main = model.lm_head(h).argmax(-1)
                for m, logits in enumerate(model.mtp_logits(h, xb, pos), 1):
                    agree[m - 1] += (logits.argmax(-1) == main)[:, m:].float().mean() * len(xb)
    finally:
        model.train(was_training)
    return (agree / n).tolist()


def heldout_code_texts(val_frac=0.02):
    """Held-out code for bits-per-byte that pretraining never trains on: the stdlib files
    train_pretrain.py holds out for validation (the same reader, stdlib_docs, and is_validation with
    its default --val-frac 0.02), in hash order. (eval.py adds solved test-split tasks.)"""
    hashed = sorted((doc_hash(text), text) for text in stdlib_docs(Counter()))
    return [text for h, text in hashed if is_validation(h, val_frac)]


def prep_minutes(args, mix, user_data, tok=None, n_tasks=200, sample_mb=0.5):
    """(minutes, how they were estimated) of train_pretrain.py's data preparation (prepare on
    rank 0, one core, once per data definition) on THIS machine's CPU: timed on a sample here and
    scaled linearly. Generating and rendering `n_tasks` env tasks, times --tasks-n (all are generated,
    whatever --source-mb); hashing, the leak filter and tokenizing those and the first `sample_mb` MB
    of every other source, times each source's size (capped at --source-mb); training the tokenizer
    at --vocab-size on the sample, times the --tok-train-mb it trains on (none when `tok`, e.g.
    --init-from's, is given); the held-out index, as it is. Repair and agent transcripts (--repair-frac,
    --agent-n: sandbox runs) are not counted. About 2 s; `lab/gpu_check.py` reports the measured time
    beside it."""
    import env
    from data import tasks
    clock = time.perf_counter
    t = clock()
    index = tasks.heldout_index(args.holdout_n)
    fixed_s, t = clock() - t, clock()
    levels = tasks.parse_difficulties(args.task_difficulties)
    task_texts = [env.corpus_text(x) for x in tasks.generate_tasks("train", n_tasks, seed=args.seed, difficulties=levels)]
    gen_s, task_bytes = (clock() - t) / n_tasks, sum(map(len, task_texts)) / n_tasks
    samples, sizes = {}, {}
    for name in mix:
        if name.startswith("agent"):
            samples[name], sizes[name] = [], 0
            continue
        if name == "tasks":
            kept = min(args.tasks_n, math.ceil(args.source_mb * 1e6 / task_bytes)) if args.source_mb else args.tasks_n
            samples[name], sizes[name] = task_texts, kept * task_bytes
            continue
        docs = load_source(name, user_data.get(name), Counter(), args)     # capped at --source-mb
        samples[name] = list(capped(docs, sample_mb))
        if name in user_data:    # a --data source by its files' sizes (reading it all could take long)
            path, exts = user_data[name], {"." + e.strip().lstrip(".") for e in args.data_ext.split(",")}
            size = os.path.getsize(path) if os.path.isfile(path) else sum(
                os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs
                if os.path.splitext(f)[1] in exts)
            sizes[name] = min(size, args.source_mb * 1e6) if args.source_mb else size
        else:                    # the stdlib: the rest of it read (~11 MB, a fraction of a second)
            sizes[name] = sum(map(len, samples[name])) + sum(map(len, docs))
    sample = [d for s in samples.values() for d in s]
    tok_s = tok_bytes = 0.0
    if tok is None:
        t = clock()
        tok = train_tokenizer(sample, args.vocab_size)
        tok_s = (clock() - t) / sum(map(len, sample))
        tok_bytes = sum(min(sizes[n], args.tok_train_mb * 1e6 * mix[n] / sum(mix.values())) for n in mix)

    def per_byte(docs):          # what prepare does to a document once read: hash, leak filter, tokens
        t = clock()
        for d in docs:
            doc_hash(d)
            tasks.is_heldout(d, index)
        for ids in tok.encode_batch(docs):
            np.asarray(ids + [tok.eot_id], dtype=np.uint16)
        return (clock() - t) / max(1, sum(map(len, docs)))
    total_s = (fixed_s + args.tasks_n * gen_s + tok_bytes * tok_s
               + sum(sizes[n] * per_byte(samples[n]) for n in mix))
    basis = (f"timed on this machine's CPU on {n_tasks} tasks and {sample_mb} MB per source, scaled to "
             f"{args.tasks_n} tasks, {sum(sizes.values()) / 1e6:.0f} MB of text, "
             f"{tok_bytes / 1e6:.0f} MB of tokenizer training; repair transcripts not counted")
    return total_s / 60, basis
