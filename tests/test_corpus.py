"""corpus.py's pieces in process (train_pretrain.py runs them end to end in test_pretrain.py / test_leakage.py)."""
import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from data import corpus
import env
from sandbox import SandboxPool
from data.tasks import generate_tasks, load_humaneval
from data import repair
from data import tasks  # noqa: E402


def test_parse_sources_names_unnamed_sources_and_drops_zero_weights(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    user, mix = corpus.parse_sources([str(tmp_path / "a"), f"mine={tmp_path / 'b'}", str(tmp_path / "c")],
                                   "stdlib=0,tasks=0.5,data=0.2,mine=0.2,data2=0.1")
    assert user == {"data": str(tmp_path / "a"), "mine": str(tmp_path / "b"), "data2": str(tmp_path / "c")}
    assert mix == {"tasks": 0.5, "data": 0.2, "mine": 0.2, "data2": 0.1}


@pytest.mark.parametrize("specs, mix, message", [
    ([], "stdlib=x", "bad entry"), ([], "stdlib=inf", "finite"), ([], "stdlib=0", "all weights are zero"),
    (["tasks=DIR"], "tasks=1", "already taken"), (["DIR"], "stdlib=1", "has no weight"),
])
def test_parse_sources_errors_are_one_line(tmp_path, capsys, specs, mix, message):
    with pytest.raises(SystemExit):
        corpus.parse_sources([s.replace("DIR", str(tmp_path)) for s in specs], mix)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_capped_stops_before_reading_past_the_cap():
    read = []

    def docs():
        for i in range(100):
            read.append(i)
            yield "x" * 400_000
    assert len(list(corpus.capped(docs(), 1.0))) == 3 and len(read) == 3     # 3 x 0.4 MB reach 1 MB
    assert len(list(corpus.capped(iter(["a"] * 7), 0))) == 7                 # 0 = everything


def test_read_jsonl_counts_what_it_skips(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": "def f():\n    return 1\n"}), "{broken", json.dumps({"body": "no field"}),
             json.dumps({"text": "   "}), json.dumps({"text": "y" * 3000}), '{"text": "\\ud800"}']
    path.write_text("\n".join(lines) + "\n")
    skipped = Counter()
    assert list(corpus.read_jsonl(str(path), skipped, max_kb=2)) == ["def f():\n    return 1\n"]
    assert skipped == {"bad_json": 3, "empty": 1, "huge": 1}


def test_tasks_source_keeps_to_the_task_difficulties():
    args = SimpleNamespace(tasks_n=60, seed=0, task_difficulties="1-2", repair_frac=0.0, source_mb=0)
    docs = list(corpus.load_source("tasks", None, Counter(), args, {"tasks": lambda: repair.tasks_source(args)}))
    wanted = generate_tasks("train", 60, seed=0, difficulties=[1, 2])
    assert {t.difficulty for t in wanted} == {1, 2}
    assert docs == [env.corpus_text(t) for t in wanted]
    args.task_difficulties = ""
    everything = list(corpus.load_source("tasks", None, Counter(), args, {"tasks": lambda: repair.tasks_source(args)}))
    assert docs != everything and everything == [env.corpus_text(t) for t in generate_tasks("train", 60, seed=0)]


def test_inputs_targets_feed_context_ids_but_never_train_on_them():
    V = 10
    xy = torch.tensor([[1, 2, 13, 14, 5]])          # 13, 14: context-only ids of tokens 3, 4
    x, y = corpus.inputs_targets(xy, V)
    assert x.tolist() == [[1, 2, 3, 4]] and y.tolist() == [[2, -1, -1, 5]]


def test_heldout_filter_catches_renamed_functions_and_copied_prompts():
    index = tasks.heldout_index(50)
    task = generate_tasks("test", 50, seed=0)[3]
    assert tasks.is_heldout(env.corpus_text(task), index)
    assert tasks.is_heldout("import math\n\n" + load_humaneval()[0].prompt + "    pass\n", index)   # the prompt
    assert tasks.is_heldout("def plus(p, q):\n    return p + q\n", index)                          # HumanEval/53
    assert not tasks.is_heldout("def keep(v):\n    return v + 100003\n", index)
    assert not tasks.is_heldout("plain text, no code\n", index)


def test_bits_per_byte_skips_special_tokens():
    class Tok:
        vocab_size, eot_id, pad_id = 4, 2, 3
        decode_bytes = staticmethod(lambda ids: {0: b"a", 1: b"\xc3\xa9"}.get(ids[0], b"<special>"))
    nbytes = corpus.token_bytes(Tok())
    assert nbytes.tolist() == [1, 2, 0, 0]
    nll = torch.tensor([1.0, 2.0, 5.0, 7.0])
    assert corpus.nats_and_bytes_of(nll, torch.tensor([0, 1, 2, -1]), nbytes) == (3.0, 3)
    assert corpus.to_bits_per_byte(3.0, 3) == pytest.approx(1 / math.log(2))


def test_prepared_agent_cache_holds_tool_tokens_and_marks_context(tmp_path):
    """The "agent" source through corpus.prepare itself (the path train_pretrain.py takes): its cache
    holds the tool tokens as their ids (never as spelt-out text) and every issue and observation id
    as context (id + vocab size, no target); the actions are targets. Fails when prepare encodes a
    transcript as plain text."""
    import numpy as np
    from data import repos
    from tokenizer import train_tokenizer
    ts = repos.generate_repo_tasks("train", 12, seed=0, difficulties=[1, 2])
    with SandboxPool(workers=1) as pool:
        docs = repos.transcripts(ts, pool)
    tok = train_tokenizer(list(docs), 400).with_tools()
    args = SimpleNamespace(source_mb=0, val_frac=0.0)
    prep = corpus.prepare(args, {"agent": 1.0}, {}, tok, str(tmp_path), lambda d: False,
                          {"agent": lambda: iter(docs)})
    ids = np.concatenate([a for a in corpus.open_caches(prep).values()]).astype(np.int64).tolist()
    V, tools = tok.vocab_size, set(tok.tool_ids.values())
    assert {tok.tool_ids["<|read|>"], tok.tool_ids["<|end|>"], tok.tool_ids["<|edit|>"]} <= set(ids)   # targets
    assert tok.tool_ids["<|obs|>"] + V in ids and tok.tool_ids["<|obs|>"] not in ids                    # context
    assert "<|end|>" not in tok.decode([i % V for i in ids if i % V not in tools])                     # never text
    assert tok.decode([i - V for i in ids if i >= V]).startswith("# Issue")
