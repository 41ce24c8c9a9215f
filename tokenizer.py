"""
A byte-level BPE tokenizer for code: our own trainer, tiktoken for encoding/decoding.

    tok = train_tokenizer(stdlib_texts(), 8192)      # train on the stdlib sources (train_pretrain.py does)
    python -c "from tokenizer import Tokenizer; print(Tokenizer.load('tok.json').encode('def f(x):'))"

Why its own module: the pretraining, RL and eval scripts must all tokenize *identically*
(checkpoints embed `to_dict()`; the prefix property below keeps the corpus's ids the harness's), so the
tokenizer lives in one small file that every script imports instead of inside train_pretrain.py.

Training (minbpe's algorithm, made incremental like nanochat's rustbpe): the text is split into
pre-tokens by a regex, identical pre-tokens are counted once ("words" with counts), and BPE runs
on the unique words. Instead of recounting every pair after each merge (O(corpus) per merge), we
keep pair -> count and pair -> set of word ids, update only the words that contain the merged
pair, and find the best pair with a max-heap with lazy deletion. Ties: highest count, then the
smallest (left id, right id), so the result is deterministic (tests/test_tokenizer.py checks it
against merges worked out by hand).

Encoding goes through a `tiktoken.Encoding` built from the trained ranks (fast, battle-tested,
byte-exact round trip); it is never fetched from the network (no `tiktoken.get_encoding`).
"""
import base64
import hashlib
import heapq
import json
import os
from collections import Counter, defaultdict
from typing import Iterable

import regex
import tiktoken

EOT = "<|endoftext|>"
PAD = "<|pad|>"
FORMAT = "codebpe-v1"
# The agent's tool format (env.py, "tools"): one special token opens each action, <|end|> closes it,
# and an observation is fed between <|obs|> and <|/obs|>: raw text between delimiters, no JSON escaping
# (nanochat's tool use: special tokens around a raw payload); <|summary|> is the harness's request for a
# summary, which the model writes and closes by <|end|>. A tokenizer has them only after
# with_tools() (infra/surgery.py add_tokens gives the model their rows): the base recipe never sees them.
TOOL_TOKENS = ("<|ls|>", "<|read|>", "<|edit|>", "<|test|>", "<|submit|>", "<|end|>", "<|obs|>", "<|/obs|>",
               "<|summary|>", "<|grep|>", "<|run|>")

# Split pattern: GPT-4's cl100k pattern adapted to code. Kept from GPT-4: words with one optional
# leading space/punctuation char, digits in groups of 1-3, punctuation runs with an optional leading
# space. Changed for code:
# (1) contractions ('s, 't, ...) are dropped: they split string literals like 'state';
# (2) a newline can only be the LAST character of a pre-token (it may close a word, punctuation or
#     trailing blanks: "self\n", "):\n", "   \n"); it never absorbs the next line's indentation or
#     the next blank line (GPT-4's `\s+(?!\S)` would make "\n       " one pre-token);
# (3) a run of spaces/tabs is kept whole (no `(?!\S)` backoff gluing the last indent space to the
#     keyword), so "\n" + "        " + "return" learns indentation tokens of 4, 8, 12... spaces.
# Ending lines on the previous token (2) recovers GPT-4's compression on code (3.52 vs 3.53 bytes/
# token on held-out stdlib tests at 8192 vocab; 3.30 if every newline is its own pre-token).
# A consequence of (2): no pre-token continues past a "\n" and no alternative looks past it, so for
# ANY prompt P ending in "\n" and ANY completion C: encode(P) + encode(C) == encode(P + C). The harness
# no longer relies on it (a Hugging Face tokenizer lacks it, hf.py): the corpus encodes a prompt and its
# body apart (repair.Transcript.cuts), which with this pattern gives the ids of the whole.
PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?+\p{L}+(?:\r?\n)?",  # words: "def", " self", ".append", "_name", "x\n"
    r"\p{N}{1,3}",                            # numbers: 1-3 digit groups (GPT-4)
    r" ?[^\s\p{L}\p{N}]++(?:\r?\n)?",         # punctuation runs: "(", " ==", "):\n", "\"\"\"\n"
    r"[^\S\r\n]*\r?\n",                       # (trailing blanks +) one newline, LF or CRLF
    r"[^\S\r\n]+",                            # indentation / other runs of spaces and tabs
    r"\r",                 # a lone CR (every char must match: tiktoken drops unmatched text)
])


def _merge(word, a, b, new):
    """Replace every non-overlapping (a, b) in `word`, left to right (minbpe's merge)."""
    out, i, n = [], 0, len(word)
    while i < n:
        if i < n - 1 and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def bpe_train_words(word_counts: dict[bytes, int], n_tokens: int) -> list[bytes]:
    """Incremental BPE on unique words. Returns the token byte strings in rank order (256 bytes first)."""
    vocab = [bytes([i]) for i in range(256)]
    ids = {t: i for i, t in enumerate(vocab)}
    words = [list(w) for w in word_counts]
    counts = list(word_counts.values())
    stats: dict[tuple[int, int], int] = defaultdict(int)   # pair -> weighted occurrence count
    where: dict[tuple[int, int], set] = defaultdict(set)   # pair -> ids of words that (may) contain it
    for wi, w in enumerate(words):
        for p in zip(w, w[1:]):
            stats[p] += counts[wi]
            where[p].add(wi)
    # Max-heap via negated counts. Entries go stale when a count changes; we push the new count
    # and skip popped entries whose count no longer matches (lazy deletion, cheaper than decrease-key).
    heap = [(-c, p) for p, c in stats.items()]
    heapq.heapify(heap)
    while len(vocab) < n_tokens and heap:
        neg, pair = heapq.heappop(heap)
        if stats.get(pair, 0) != -neg:
            continue
        a, b = pair
        merged = vocab[a] + vocab[b]
        # Two different pairs can spell the same bytes ("ab"+"c" vs "a"+"bc"); tiktoken keys ranks by
        # bytes, so reuse the existing id instead of creating a duplicate token.
        new = ids.get(merged)
        if new is None:
            new = ids[merged] = len(vocab)
            vocab.append(merged)
        delta: dict[tuple[int, int], int] = defaultdict(int)
        for wi in where.pop(pair):
            w = words[wi]
            nw = _merge(w, a, b, new)
            if len(nw) == len(w):      # stale membership: the pair left this word in an earlier merge
                continue
            c = counts[wi]
            for p in zip(w, w[1:]):
                delta[p] -= c
            for p in zip(nw, nw[1:]):
                delta[p] += c
                if new in p:
                    where[p].add(wi)
            words[wi] = nw
        for p, d in delta.items():
            if d:
                c = stats[p] = stats[p] + d
                if c > 0:
                    heapq.heappush(heap, (-c, p))
                else:
                    del stats[p]
    return vocab


def count_words(texts: Iterable[str]) -> Counter:
    """Pre-tokenize and count identical pre-tokens (BPE never merges across them)."""
    pat, words = regex.compile(PATTERN), Counter()
    for text in texts:
        words.update(pat.findall(text))
    return Counter({w.encode("utf-8", "surrogatepass"): c for w, c in words.items()})


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> "Tokenizer":
    """Train on `texts`; vocab_size counts the 2 special tokens. A corpus too small to supply
    enough merges yields a smaller vocabulary (check `.vocab_size`)."""
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes + 2 specials), got {vocab_size}")
    return Tokenizer(bpe_train_words(count_words(texts), vocab_size - 2))


class Tokenizer:
    """Thin wrapper around a tiktoken.Encoding; ids 0..n-1 are BPE ranks, then EOT, PAD, and with
    tools=True the TOOL_TOKENS (ids in `tool_ids`, by their text)."""

    def __init__(self, ranks: list[bytes], pattern: str = PATTERN, name: str = FORMAT, tools: bool = False):
        self.ranks, self.pattern, self.name, self.tools = list(ranks), pattern, name, tools
        n = len(self.ranks)
        self.eot_id, self.pad_id = n, n + 1
        self.tool_ids = {t: n + 2 + i for i, t in enumerate(TOOL_TOKENS)} if tools else {}
        self.specials = {EOT: self.eot_id, PAD: self.pad_id, **self.tool_ids}
        self.vocab_size = n + len(self.specials)
        self.enc = tiktoken.Encoding(
            name=name, pat_str=pattern, mergeable_ranks={t: i for i, t in enumerate(self.ranks)},
            special_tokens=self.specials, explicit_n_vocab=self.vocab_size)

    def with_tools(self) -> "Tokenizer":
        """The same tokenizer plus the tool tokens, at the ids after PAD (every other id unchanged)."""
        return Tokenizer(self.ranks, self.pattern, self.name, tools=True)

    # Special-token text in the input is ordinary text: a code file that mentions "<|endoftext|>" (or
    # "<|obs|>") must not be able to inject a document boundary or a tool call. Specials are only ever
    # added by id.
    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids), errors="replace")

    def text_ids(self, ids) -> list[int]:
        """The ids that spell text: the special tokens, and ids past the vocabulary (rows a model's
        vocabulary has beyond the tokenizer's), dropped. Here the BPE ranks, the ids below EOT."""
        return [t for t in ids if t < self.eot_id]

    def decode_bytes(self, ids) -> bytes:
        return self.enc.decode_bytes(list(ids))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "pattern": self.pattern,
                "ranks": [base64.b64encode(t).decode("ascii") for t in self.ranks],
                "special_tokens": dict(self.specials)}

    def fingerprint(self) -> str:
        """Stable hash of ranks + pattern + specials: token caches and checkpoints are keyed by it."""
        d = self.to_dict()
        d.pop("name")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @staticmethod
    def from_dict(d: dict) -> "Tokenizer":
        if isinstance(d, dict) and d.get("format") == "hf-bpe-v1":   # a Hugging Face tokenizer.json's (hf.py)
            from hf import HFTokenizer
            return HFTokenizer.from_dict(d)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else None
            raise ValueError(f"not a {FORMAT} tokenizer (format={found!r})")
        try:
            ranks = [base64.b64decode(s, validate=True) for s in d["ranks"]]
            pattern, specials = d["pattern"], d["special_tokens"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed tokenizer dict: {e!r}") from None
        if ranks[:256] != [bytes([i]) for i in range(256)] or len(set(ranks)) != len(ranks):
            raise ValueError("tokenizer ranks must start with the 256 single bytes and be unique")
        base = {EOT: len(ranks), PAD: len(ranks) + 1}
        tools = {t: len(ranks) + 2 + i for i, t in enumerate(TOOL_TOKENS)}
        if specials not in (base, {**base, **tools}):
            raise ValueError(f"unexpected special tokens {specials!r}")
        try:
            return Tokenizer(ranks, pattern, d.get("name", FORMAT), tools=specials != base)
        except Exception as e:   # e.g. a pattern the regex engine rejects
            raise ValueError(f"tiktoken rejected the tokenizer: {e!r}") from None

    def save(self, path):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f)
        os.replace(tmp, path)   # atomic: a crashed save never leaves a half-written tokenizer

    @staticmethod
    def load(path) -> "Tokenizer":
        try:
            with open(path) as f:
                return Tokenizer.from_dict(json.load(f))
        except (OSError, ValueError) as e:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"bad tokenizer file {path}: {e}") from None


def stdlib_texts(max_mb: float | None = None) -> list[str]:
    """Default corpus: the running interpreter's stdlib *.py (no test/, idlelib, site-packages),
    sorted by path, truncated after `max_mb` MB of text. Deterministic for a given Python build."""
    import pathlib
    import sysconfig
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = lambda parts: any(p in ("site-packages", "idlelib") or p.startswith("test") for p in parts)
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip(path.relative_to(root).parts[:-1]):
            continue
        try:
            texts.append(path.read_text("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        total += len(texts[-1])
        if max_mb is not None and total >= max_mb * 1e6:
            break
    return texts
