"""
A byte-level BPE tokenizer for code: our own trainer, tiktoken for encoding/decoding.

    tok = train_tokenizer(texts, 8192)      # texts: e.g. data/corpus.py's stdlib_docs, as train_pretrain.py
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
import unicodedata
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
# with_tools() (model.add_tokens gives the model their rows): the base recipe never sees them.
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
        if isinstance(d, dict) and d.get("format") == HF_FORMAT:   # a Hugging Face tokenizer.json's
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


# ----------------------------------------------------------------------------------------------
# tokenizer.json -> a tiktoken.Encoding (HFTokenizer), and any Tokenizer -> tokenizer.json

def bytes_to_unicode():
    """GPT-2's map from the 256 bytes to printable characters, in which byte-level BPE files spell their
    tokens: printable Latin-1 bytes stand for themselves, the others for chr(256 + n), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


# The regex of transformers' ByteLevel pre-tokenizer (GPT-2's), and the same after a Digits pre-tokenizer
# that isolates every numeric character (StarCoder's, so Granite's): digits are single pre-tokens, and
# the trailing-space rule (?!\S) sees a digit as the end of a piece.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DIGITS_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
HF_FORMAT = "hf-bpe-v1"


def pre_tokenizer_pattern(pre):
    """tokenizer.json's pre_tokenizer -> one regex that splits text into the same pieces, for the forms
    byte-level models use: ByteLevel with its regex (GPT-2, OLMoE); Split(regex, isolated) then ByteLevel
    without one (Qwen, Llama 3); Digits(individual) then ByteLevel (StarCoder, Granite)."""
    steps = pre["pretokenizers"] if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]
    last = steps[-1] if steps else {}
    if not steps or kinds[-1] != "ByteLevel" or last.get("add_prefix_space"):
        raise ValueError(f"pre_tokenizer {kinds}: need a ByteLevel pre-tokenizer without add_prefix_space")
    if kinds == ["ByteLevel"] and last.get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
        return DIGITS_PATTERN
    split = steps[0]
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True) \
            and "Regex" in split.get("pattern", {}) and split.get("behavior") == "Isolated" \
            and not split.get("invert"):
        return split["pattern"]["Regex"]
    raise ValueError(f"pre_tokenizer {kinds}: not a form hf.py reads (ByteLevel; Split + ByteLevel; "
                     "Digits + ByteLevel)")


class HFTokenizer(Tokenizer):
    """tokenizer.py's Tokenizer for a tokenizer.json: ids are the model's own (special tokens may sit
    anywhere, Granite's end-of-text is id 0), `ranks` maps token bytes to ids, `added` the added tokens
    (content -> (id, special?)); eot_id, pad_id the model's; with_tools() puts the tool tokens after the
    highest id. encode() never produces a special token: text that spells one is text (special tokens are
    added by id, as everywhere in this project). Added tokens that are not special (GPT-NeoX's, so OLMoE's,
    runs of spaces; Qwen3's <think>) are text: found first, longest first, as the tokenizers library
    does, and the text between them is encoded apart."""

    def __init__(self, ranks, pattern, added, eot_id, pad_id, nfc=False, name=HF_FORMAT, tools=False):
        self.ranks, self.pattern, self.added = dict(ranks), pattern, dict(added)
        self.nfc, self.name = nfc, name
        self.eot_id, self.pad_id, self.tools = eot_id, pad_id, tools
        top = max([*self.ranks.values(), *(i for i, _ in self.added.values())]) + 1
        self.tool_ids = {t: top + i for i, t in enumerate(TOOL_TOKENS)} if tools else {}
        self.specials = {**{t: i for t, (i, _) in self.added.items()}, **self.tool_ids}
        self.vocab_size = top + len(self.tool_ids)
        words = sorted((t for t, (_, special) in self.added.items() if not special), key=len, reverse=True)
        self.words = regex.compile("(" + "|".join(map(regex.escape, words)) + ")") if words else None
        self.text = frozenset(self.ranks.values()) | frozenset(self.specials[t] for t in words)
        self.known = self.text | frozenset(self.specials.values())
        self.enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=self.ranks,
                                     special_tokens=self.specials)

    def with_tools(self):
        return HFTokenizer(self.ranks, self.pattern, self.added, self.eot_id, self.pad_id, self.nfc,
                           self.name, tools=True)

    def encode(self, text):
        text = unicodedata.normalize("NFC", text) if self.nfc else text
        if self.words is None:
            return self.enc.encode_ordinary(text)
        ids = []     # split() alternates: text, an added word, text, ...
        for k, piece in enumerate(self.words.split(text)):
            ids += [self.specials[piece]] if k % 2 else self.enc.encode_ordinary(piece) if piece else []
        return ids

    def encode_batch(self, texts):
        if self.words is not None:
            return [self.encode(t) for t in texts]
        return self.enc.encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts] if self.nfc
                                              else texts)

    def text_ids(self, ids):
        return [t for t in ids if t in self.text]

    # A model's vocabulary may have rows past the tokenizer's (Qwen3: 151936 rows, 151669 tokens): a
    # sampled id there has no text and is dropped, as env.as_sample drops every special id.
    def decode(self, ids):
        return self.enc.decode([t for t in ids if t in self.known], errors="replace")

    def decode_bytes(self, ids):
        return self.enc.decode_bytes([t for t in ids if t in self.known])

    def to_dict(self):
        order = sorted(self.ranks, key=self.ranks.get)
        return {"format": HF_FORMAT, "name": self.name, "pattern": self.pattern, "nfc": self.nfc,
                "tokens": [t.hex() for t in order], "ids": [self.ranks[t] for t in order],
                "added": [[t, i, s] for t, (i, s) in self.added.items()], "eot_id": self.eot_id,
                "pad_id": self.pad_id, "tools": self.tools}

    @staticmethod
    def from_dict(d):
        try:
            ranks = {bytes.fromhex(t): i for t, i in zip(d["tokens"], d["ids"], strict=True)}
            return HFTokenizer(ranks, d["pattern"], {t: (i, s) for t, i, s in d["added"]}, d["eot_id"],
                               d["pad_id"], d["nfc"], d.get("name", HF_FORMAT), d["tools"])
        except Exception as e:   # a missing key, a bad hex string, a pattern tiktoken rejects
            raise ValueError(f"malformed {HF_FORMAT} tokenizer dict: {type(e).__name__}: {e}") from None


def load_tokenizer(path, eos=None, pad=None):
    """tokenizer.json -> HFTokenizer. eos, pad: the model's end-of-text and padding ids (config.json),
    else tokenizer_config.json's tokens beside it, else an added "<|endoftext|>"; pad defaults to eos.
    ValueError for anything that is not a byte-level BPE tiktoken can run exactly."""
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    m = tj.get("model", {})
    if m.get("type") != "BPE" or m.get("byte_fallback") or m.get("continuing_subword_prefix") \
            or m.get("end_of_word_suffix") or m.get("dropout"):
        raise ValueError(f"{path}: not a plain byte-level BPE model ({m.get('type')})")
    norm = tj.get("normalizer")
    if norm not in (None, {"type": "NFC"}):
        raise ValueError(f"{path}: normalizer {norm} (hf.py reads none or NFC)")
    pattern = pre_tokenizer_pattern(tj.get("pre_tokenizer"))
    added = {a["content"]: (a["id"], bool(a.get("special"))) for a in tj.get("added_tokens", [])}
    odd = [a["content"] for a in tj.get("added_tokens", [])
           if not a.get("special") and (a.get("single_word") or a.get("lstrip") or a.get("rstrip"))]
    if odd:
        raise ValueError(f"{path}: added tokens {odd[:3]} match with single_word / lstrip / rstrip rules")
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    spell = lambda s: bytes(byte_of[c] for c in s)
    vocab = {t: i for t, i in m["vocab"].items() if t not in added}
    ranks = {spell(t): i for t, i in vocab.items()}
    # tiktoken merges the adjacent pair whose concatenation has the lowest id; BPE, the pair listed
    # first in merges. They agree when the merges' results have increasing ids and every other token is
    # a single byte: checked here.
    last, made = -1, set()
    for pair in m.get("merges", []):
        a, b = pair.split(" ") if isinstance(pair, str) else pair
        i = vocab.get(a + b)
        if i is None or i <= last:
            raise ValueError(f"{path}: merge {a!r} + {b!r} gives id {i}, after {last}: ids not in merge "
                             "order")
        last = i
        made.add(a + b)
    others = [t for t in vocab if len(spell(t)) > 1 and t not in made]
    if others or len([t for t in vocab if len(spell(t)) == 1]) != 256:
        raise ValueError(f"{path}: {len(others)} tokens are neither bytes nor merges (e.g. {others[:3]}), or "
                         "some of the 256 bytes are missing")
    cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    with open(cfg_path) if os.path.isfile(cfg_path) else open(os.devnull) as f:
        tc = json.loads(f.read() or "{}")

    def named(key):          # tokenizer_config.json's token (a string, or {"content": ...}) -> its id
        t = tc.get(key)
        return added.get(t.get("content") if isinstance(t, dict) else t, (None,))[0] if t else None
    for guess in (named("eos_token"), added.get("<|endoftext|>", (None,))[0]):
        eos = guess if eos is None else eos
    if eos is None:
        raise ValueError(f"{path}: no end-of-text token (config.json eos_token_id, tokenizer_config.json)")
    pad = named("pad_token") if pad is None else pad
    return HFTokenizer(ranks, pattern, added, eos, eos if pad is None else pad, nfc=norm is not None)


def tokenizer_json(tok):
    """Any Tokenizer (this project's own, or an HFTokenizer) -> a tokenizer.json dict that the tokenizers
    library encodes with the same ids. Merges are recovered from the ranks as tiktoken implies them: the
    two parts a token's bytes end in when BPE runs on them with the ranks below its own."""
    ranks = tok.ranks if isinstance(tok, HFTokenizer) else {t: i for i, t in enumerate(tok.ranks)}
    uni = bytes_to_unicode()
    spell = lambda t: "".join(uni[b] for b in t)
    merges = []
    for t, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(t) < 2:
            continue
        parts = [bytes([b]) for b in t]
        while len(parts) > 2:
            r, j = min((ranks.get(parts[j] + parts[j + 1], rank), j) for j in range(len(parts) - 1))
            if r >= rank:
                break
            parts[j:j + 2] = [parts[j] + parts[j + 1]]
        merges.append([spell(parts[0]), spell(parts[1])])
    if isinstance(tok, HFTokenizer):
        added = [(t, i, s) for t, (i, s) in tok.added.items()] + \
            [(t, i, True) for t, i in tok.tool_ids.items()]
    else:
        added = [(t, i, True) for t, i in tok.specials.items()]
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": s}
                             for t, i, s in sorted(added, key=lambda a: a[1])],
            "normalizer": {"type": "NFC"} if getattr(tok, "nfc", False) else None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": tok.pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False,
                      "vocab": {spell(t): i for t, i in ranks.items()}, "merges": merges}}
