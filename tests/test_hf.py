"""hf.py against transformers, tokenizers and safetensors (test-only packages: skipped without them), on
tiny random models of each architecture that transformers builds offline, and a byte-level BPE trained
here with the tokenizers library. Random weights are drawn at std 0.2, not transformers' 0.02, so that
attention and routing depend on the weights enough for a convention error to show (one test breaks the
RoPE conversion on purpose and sees it). What this proves, and what it cannot (real weights, real
scores): docs/gpu.md."""
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import env  # noqa: E402
import hf  # noqa: E402
from data import corpus, repair, tasks  # noqa: E402
from infra import common, plan  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tokenizer import TOOL_TOKENS, HFTokenizer, Tokenizer, load_tokenizer, train_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ["qwen3", "qwen3_moe", "granitemoe", "olmoe"]
STYLE = {"qwen3": "qwen", "qwen3_moe": "qwen", "granitemoe": "digits", "olmoe": "gpt2"}   # as the real ones
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>"]
QWEN_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
# The test set: code, prose, unicode (NFC-sensitive "e" + combining acute included), special-token text
TEXTS = [inspect.getsource(textwrap.dedent), "def f(x):\r\n\treturn  x+1  # ok\n\n\n    pass\n",
         "The quick brown fox, isn't it? It's 3.14159 and 1,000,000 -- he'd said.\n",
         "naïve cafe\u0301 東京 北京 Ünïcödé ½ ² ٣ 🙂👍🏽 \u200b end", "<|endoftext|>",
         "a<|im_start|>user\n<|pad|>b <think>hm</think>",
         "x = [1, 2, 3]  \n\n  \t y", ""]


def train_texts():
    import json as j
    return [inspect.getsource(textwrap)[:8000], inspect.getsource(j.decoder)[:4000],
            "The quick brown fox jumps over the lazy dog. " * 5 + "naïve café 東京 北京 1234567 3.14\n",
            "def f(x):\n    return x + 1\n" * 20]


WORDS = {"qwen": ["<think>"], "digits": [], "gpt2": ["  ", "    ", "        "]}   # added, not special


def lib_tokenizer(style, path, vocab=700, specials=SPECIALS):
    """A byte-level BPE trained with the tokenizers library, pre-tokenized as Qwen ("qwen": NFC, a Split
    regex, ByteLevel), StarCoder/Granite ("digits") or GPT-2/OLMoE ("gpt2") do, with added tokens that
    are not special as Qwen3 (<think>) and GPT-NeoX / OLMoE (runs of spaces) have; `vocab` ids in all,
    the special tokens first, written to path."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    t = tokenizers.Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=style != "qwen")
    if style == "qwen":
        t.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN_RE), "isolated")
        t.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif style == "digits":
        t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        t.pre_tokenizer = byte_level
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(train_texts(), trainers.BpeTrainer(
        vocab_size=vocab - len(WORDS[style]), special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    t.add_tokens(WORDS[style])
    t.save(str(path))
    return t


def hf_model(arch, path, vocab=700, std=0.2, seed=0, stops=False, default_ids=False):
    """A tiny random transformers model of `arch` saved in path (end-of-text id 0, pad 1, as the
    tokenizer's; default_ids: transformers' defaults); 2 layers, width 64, 4 heads over 2 KV heads, 8
    experts top-2. stops: it ends a sample after ~10 tokens on average (ends_often), so that RL's groups
    vary in length."""
    ids = {} if default_ids else dict(eos_token_id=0, pad_token_id=1, bos_token_id=None)
    c = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, **ids, initializer_range=std, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    moe = dict(c, num_experts_per_tok=2)
    T = transformers
    cfg = {"qwen3": lambda: T.Qwen3Config(**c, intermediate_size=96, head_dim=32, tie_word_embeddings=True),
           # head_dim 32 at width 64 / 4 heads: a head width apart from the model's; layer 0 dense
           "qwen3_moe": lambda: T.Qwen3MoeConfig(**moe, intermediate_size=96, moe_intermediate_size=32,
                                                 head_dim=32, num_experts=8, norm_topk_prob=True,
                                                 mlp_only_layers=[0]),
           "granitemoe": lambda: T.GraniteMoeConfig(**moe, intermediate_size=32, num_local_experts=8,
                                                    embedding_multiplier=12.0, attention_multiplier=0.05,
                                                    residual_multiplier=0.22, logits_scaling=6.0,
                                                    tie_word_embeddings=True),
           "olmoe": lambda: T.OlmoeConfig(**moe, intermediate_size=32, num_experts=8)}[arch]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if stops:
        ends_often(model)
    model.save_pretrained(str(path))
    return str(path)


@torch.no_grad()
def ends_often(model, eot=0, logit=4.4):
    """A random model that says end-of-text about one token in ten (its logit ~`logit` above the rest,
    out of 700): every embedding gets 1 in dimension 0, which the residual stream carries to the final
    norm as a large positive constant (weights at std 0.02 add little), and only end-of-text's output
    row reads it. The length penalty then gives RL groups rewards that differ, with no model passing."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    scale = getattr(model.config, "embedding_multiplier", 1.0)
    emb[:, 0] = 1.0 / scale
    h0 = model.config.hidden_size ** 0.5          # the final norm's output in dimension 0, about
    extra = logit / h0 * getattr(model.config, "logits_scaling", 1.0)
    if head is emb:                               # tied: every row reads the constant, end-of-text more
        emb[eot, 0] += extra
    else:
        head[:, 0] = 0.0
        head[eot, 0] = extra


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizers")
    return {s: (str(d / f"{s}.json"), lib_tokenizer(s, d / f"{s}.json")) for s in ("qwen", "digits", "gpt2")}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tok_files):
    """Each architecture's tiny model directory: config.json, model.safetensors, tokenizer.json."""
    out = {}
    for arch in ARCHS:
        d = hf_model(arch, tmp_path_factory.mktemp(arch))
        with open(tok_files[STYLE[arch]][0]) as src, open(os.path.join(d, "tokenizer.json"), "w") as dst:
            dst.write(src.read())
        out[arch] = d
    return out


# ---------------------------------------------------------------------------------------------
# safetensors, read and written by hf.py's own few lines

def test_safetensors_round_trip_with_the_library(tmp_path):
    g = torch.Generator().manual_seed(0)
    ts = {"a": torch.randn(3, 5, generator=g), "b.bf16": torch.randn(4, 2, generator=g).bfloat16(),
          "c": torch.randn(7, generator=g).half(), "i": torch.arange(6, dtype=torch.int64).view(2, 3),
          "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    hf.write_safetensors(tmp_path / "ours.safetensors", ts)
    theirs = safetensors_torch.load_file(str(tmp_path / "ours.safetensors"))
    safetensors_torch.save_file(ts, str(tmp_path / "lib.safetensors"))
    back = hf.read_safetensors(tmp_path / "lib.safetensors")
    for k, t in ts.items():
        for other in (theirs[k], back[k]):
            assert other.dtype == t.dtype and other.shape == t.shape and torch.equal(other, t), k


# ---------------------------------------------------------------------------------------------
# The tokenizer: tokenizer.json -> tiktoken, ids as the tokenizers library's

@pytest.mark.parametrize("style", ["qwen", "digits", "gpt2"])
def test_tokenizer_ids_equal_the_tokenizers_library(tok_files, style):
    path, lib = tok_files[style]
    tok = load_tokenizer(path, eos=0, pad=1)
    lib.encode_special_tokens = True     # special-token text is text: special tokens are only added by id
    for text in TEXTS + train_texts():
        ids = tok.encode(text)
        assert ids == lib.encode(text, add_special_tokens=False).ids, (style, text[:60])
        assert tok.decode(ids) == lib.decode(ids) and tok.text_ids(ids) == ids
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert not set(tok.encode("<|endoftext|><|im_start|>")) & {0, 1, 2}
    # the model's specials, the tool tokens after every id, the round trip through a checkpoint's dict
    assert (tok.eot_id, tok.pad_id, tok.specials["<|im_start|>"], tok.vocab_size) == (0, 1, 2, 700)
    tools = tok.with_tools()
    assert list(tools.tool_ids) == list(TOOL_TOKENS) and min(tools.tool_ids.values()) == 700
    assert tools.vocab_size == 700 + len(TOOL_TOKENS) and tools.encode(TEXTS[0]) == tok.encode(TEXTS[0])
    for t in (tok, tools):
        back = Tokenizer.from_dict(json.loads(json.dumps(t.to_dict())))
        assert type(back) is HFTokenizer and back.tools == t.tools
        assert back.fingerprint() == t.fingerprint()
        assert back.encode(TEXTS[3]) == t.encode(TEXTS[3])
    assert tools.fingerprint() != tok.fingerprint()
    assert tok.decode([65, 5000, 0]) == tok.decode([65]) + "<|endoftext|>"   # an id past the vocabulary


def test_tokenizer_json_pieces_hf_py_refuses(tmp_path, tok_files):
    tj = json.load(open(tok_files["gpt2"][0]))
    for key, value, says in [("pre_tokenizer", {"type": "Whitespace"}, "pre_tokenizer"),
                             ("normalizer", {"type": "Lowercase"}, "normalizer")]:
        (tmp_path / "t.json").write_text(json.dumps({**tj, key: value}))
        with pytest.raises(ValueError, match=says):
            load_tokenizer(tmp_path / "t.json", eos=0)
    swapped = dict(tj, model=dict(tj["model"], merges=tj["model"]["merges"][::-1]))   # ids against merges
    (tmp_path / "t.json").write_text(json.dumps(swapped))
    with pytest.raises(ValueError, match="merge order"):
        load_tokenizer(tmp_path / "t.json", eos=0)


# ---------------------------------------------------------------------------------------------
# Parity with transformers: logits, greedy generation, experts

@pytest.mark.parametrize("arch", ARCHS)
def test_forward_generation_and_routing_equal_transformers(model_dirs, arch):
    r = hf.compare(model_dirs[arch], n_tokens=32)
    assert r["max_abs_logit_diff"] <= 1e-4, r
    assert r["same_greedy"] and r["same_token_ids"] and r["exact"], r
    assert r["same_experts"] is (None if arch == "qwen3" else True), r
    assert r["moe_layers"] == {"qwen3": 0, "qwen3_moe": 1, "granitemoe": 2, "olmoe": 2}[arch]


def test_the_parity_check_sees_a_convention_error(model_dirs, monkeypatch):
    """Without the RoPE conversion (transformers' rotation taken as model.py's) the logits part, greedy
    decoding and routing differ: the parity test above can fail."""
    monkeypatch.setattr(hf, "rope_flip", lambda w, head_dim: w)
    for arch in ("qwen3_moe", "olmoe"):
        r = hf.compare(model_dirs[arch], n_tokens=8)
        assert r["max_abs_logit_diff"] > 1e-2 and not r["exact"], r


def test_load_checkpoint_takes_a_model_directory(model_dirs, tmp_path):
    d = model_dirs["granitemoe"]
    model, tok, ck = hf.load_checkpoint(d)
    c = model.config
    assert (c.n_expert, c.top_k, c.n_shared_expert, c.qk_norm, c.tie_embeddings, c.balance) == \
        (8, 2, 0, "none", True, "none")
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling) == \
        (12.0, 0.22, 0.05, 6.0)
    assert model.lm_head.weight is model.wte.weight
    assert all(m.bias.abs().sum() == 0 for m in model.moe_layers())       # routing as transformers'
    assert ck["kind"] == "hf" and ck["hf"]["model_type"] == "granitemoe"
    assert GPTConfig(**ck["model_config"]) == c
    # a checkpoint written from it (train_pretrain / train_rl do) loads as the same model and tokenizer
    common.save_checkpoint(tmp_path / "ck.pt", model, tok)
    again, tok2, _ = hf.load_checkpoint(str(tmp_path / "ck.pt"))
    x = torch.randint(0, 700, (2, 9))
    assert torch.equal(again(x)[0], model(x)[0]) and tok2.fingerprint() == tok.fingerprint()
    assert again.lm_head.weight is again.wte.weight
    # config.json alone (a --dry-run's plan): the model on the meta device, no weights read
    os.makedirs(tmp_path / "cfg_only")
    with open(os.path.join(d, "config.json")) as f, open(tmp_path / "cfg_only" / "config.json", "w") as g:
        g.write(f.read())
    meta, tok3, _ = hf.load_checkpoint(str(tmp_path / "cfg_only"), "meta")
    assert meta.wte.weight.is_meta and tok3 is None


def fails(capsys, call):
    """The one-line error and exit code 2 of infra/cli.die, from an in-process call."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_bad_model_directory_is_a_one_line_error(tmp_path, model_dirs, capsys):
    (tmp_path / "d").mkdir()
    c = json.load(open(os.path.join(model_dirs["qwen3"], "config.json")))
    for bad, says in [({**c, "model_type": "llama"}, "model_type 'llama'"),
                      ({**c, "attention_bias": True}, "attention_bias"),
                      ({**c, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope")]:
        (tmp_path / "d" / "config.json").write_text(json.dumps(bad))
        assert says in fails(capsys, lambda: hf.load_checkpoint(str(tmp_path / "d")))


def test_check_prints_one_json_line_and_refuses_bad_input(tmp_path, model_dirs, capsys):
    """`python hf.py check DIR`: one JSON line of figures, exit code 0 when exact; a missing directory,
    a malformed or unreadable config.json, an architecture hf.py does not read, or a missing --out-dir
    for export: one `error: ...` line, exit code 2."""
    with pytest.raises(SystemExit) as e:
        hf.main(["check", model_dirs["olmoe"], "--tokens", "4"])
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert e.value.code == 0 and len(out) == 1 and report["exact"] and report["greedy_tokens"] == 4, out
    assert {"max_abs_logit_diff", "same_greedy", "same_experts", "same_token_ids", "wall_s"} <= set(report)
    assert "no model directory" in fails(capsys, lambda: hf.main(["check", str(tmp_path / "nowhere")]))
    (tmp_path / "d").mkdir()
    assert "config.json" in fails(capsys, lambda: hf.main(["check", str(tmp_path / "d")]))   # none at all
    c = json.load(open(os.path.join(model_dirs["qwen3"], "config.json")))
    for text, says in [("{not json", "config.json"), ("[1, 2]", "not a JSON object"),
                       (json.dumps({k: v for k, v in c.items() if k != "hidden_size"}), "'hidden_size'"),
                       (json.dumps({**c, "model_type": "llama"}), "model_type 'llama'")]:
        (tmp_path / "d" / "config.json").write_text(text)
        assert says in fails(capsys, lambda: hf.main(["check", str(tmp_path / "d")]))
        assert says in fails(capsys, lambda: hf.main(["export", str(tmp_path / "d"), "--out-dir",
                                                      str(tmp_path / "o")]))
    assert "no checkpoint" in fails(capsys, lambda: hf.main(["export", str(tmp_path / "no.pt"), "--out-dir",
                                                             str(tmp_path / "o")]))
    assert "--out-dir" in fails(capsys, lambda: hf.main(["export", model_dirs["qwen3"]]))
    assert "model directory read" in fails(capsys, lambda: hf.main(["export", model_dirs["qwen3"],
                                                                    "--out-dir", model_dirs["qwen3"]]))


# ---------------------------------------------------------------------------------------------
# Export: a checkpoint -> a directory transformers loads with the same logits

def transformers_logits(path, x):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(x).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_export_round_trip_of_a_loaded_model(model_dirs, tok_files, arch, tmp_path):
    """model directory -> our GPT -> export -> transformers: the original model's logits; the exported
    tokenizer.json gives the original's ids in the tokenizers library."""
    model, tok, _ = hf.load_checkpoint(model_dirs[arch])
    out = hf.export(model, tok, str(tmp_path / "out"))
    assert out["model_type"] == arch and sorted(os.listdir(tmp_path / "out")) == \
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    x = torch.randint(0, 700, (2, 12), generator=torch.Generator().manual_seed(1))
    before, after = transformers_logits(model_dirs[arch], x), transformers_logits(str(tmp_path / "out"), x)
    assert (before - after).abs().max() <= 1e-5 and (model(x)[0] - after).abs().max() <= 1e-4
    lib = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    lib.encode_special_tokens = True
    for text in TEXTS:
        assert lib.encode(text, add_special_tokens=False).ids == tok.encode(text), text[:40]
    again = hf.compare(str(tmp_path / "out"), n_tokens=8)
    assert again["exact"], again


def own_tokenizer():
    return train_tokenizer(train_texts(), 600)


def test_export_round_trip_of_this_projects_checkpoint(tmp_path, capsys):
    """A checkpoint of this project's own MoE (no shared expert: Qwen3-MoE has none; a dense first
    layer, aux-free bias at 0) and its own tokenizer -> `python hf.py export` -> transformers."""
    tok = own_tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=64, n_layer=3, n_embd=64, n_head=4, n_kv_head=2,
                          n_expert=4, top_k=2, n_shared_expert=0, expert_hidden=32, n_mtp=1))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10 if p.ndim > 1 else 1)       # std 0.2, as the transformers models above
    common.save_checkpoint(tmp_path / "ck.pt", model, tok)
    hf.main(["export", str(tmp_path / "ck.pt"), str(tmp_path / "out")])   # `python hf.py export CKPT DIR`
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])           # one JSON line: what was written
    assert len(out) == 1 and report["model_type"] == "qwen3_moe" and report["dropped_mtp"] == 1
    assert report["out_dir"] == str(tmp_path / "out") and report["ckpt"] == str(tmp_path / "ck.pt")
    x = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    assert (model(x)[0] - transformers_logits(str(tmp_path / "out"), x)).abs().max() <= 1e-4
    lib = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    lib.encode_special_tokens = True
    for text in TEXTS + train_texts():
        assert lib.encode(text, add_special_tokens=False).ids == tok.encode(text), text[:40]
    # and back: the exported directory loads as this model, tokenizer ids unchanged
    back, tok2, _ = hf.load_checkpoint(str(tmp_path / "out"))
    assert (back(x)[0] - model(x)[0]).abs().max() <= 1e-5 and tok2.encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_export_of_a_model_whose_end_of_text_is_an_ordinary_token(tmp_path, capsys):
    """A GraniteMoe directory whose config.json keeps transformers' default eos id (2: here an ordinary
    token, the tokenizer's special ones being 0 and 1), continued as a checkpoint, exports: config.json
    keeps the id, tokenizer_config.json names no eos or pad token (no name is theirs), and transformers
    and hf.py read the directory back as the same model and tokenizer."""
    d = hf_model("granitemoe", tmp_path / "granite", default_ids=True)
    lib_tokenizer("digits", tmp_path / "granite" / "tokenizer.json", specials=SPECIALS[:2])
    assert json.load(open(tmp_path / "granite" / "config.json"))["eos_token_id"] == 2
    model, tok, _ = hf.load_checkpoint(d)
    assert tok.eot_id == tok.pad_id == 2 and 2 not in tok.specials.values()
    common.save_checkpoint(tmp_path / "ck.pt", model, tok)             # as train_pretrain --init-from DIR does
    hf.main(["export", str(tmp_path / "ck.pt"), str(tmp_path / "out")])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0])["model_type"] == "granitemoe"
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 2)
    assert not {"eos_token", "pad_token"} & set(json.load(open(tmp_path / "out" / "tokenizer_config.json")))
    x = torch.randint(0, 700, (2, 12), generator=torch.Generator().manual_seed(3))
    assert (model(x)[0] - transformers_logits(str(tmp_path / "out"), x)).abs().max() <= 1e-4
    lib = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    lib.encode_special_tokens = True
    for text in TEXTS:
        assert lib.encode(text, add_special_tokens=False).ids == tok.encode(text), text[:40]
    back, tok2, _ = hf.load_checkpoint(str(tmp_path / "out"))
    assert (tok2.eot_id, tok2.pad_id) == (2, 2) and tok2.fingerprint() == tok.fingerprint()
    assert torch.equal(back(x)[0], model(x)[0])


def test_export_refuses_what_no_architecture_computes(tmp_path, capsys):
    tok = own_tokenizer()
    for shared, nonzero, says in [(1, False, "shared experts"), (0, True, "routing bias")]:
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                              n_expert=4, top_k=2, expert_hidden=32, n_shared_expert=shared))
        if nonzero:
            model.moe_layers()[0].bias[0] = 1e-3
        common.save_checkpoint(tmp_path / "ck.pt", model, tok)
        export = ["export", str(tmp_path / "ck.pt"), "--out-dir", str(tmp_path / "o")]
        assert says in fails(capsys, lambda: hf.main(export))


# ---------------------------------------------------------------------------------------------
# The harness on a tokenizer without the prefix property

def test_pretraining_ids_are_the_harness_ids_without_the_prefix_property(tok_files):
    """GPT-2's pre-tokenizer (after StarCoder's digits: Granite's) glues a prompt's last newline to the
    body's indent, so encode(prompt) + encode(body) != encode(prompt + body): the pretraining corpus
    encodes a solved task as the harness reads it (the prompt as env.encode_prompts gives it, then the
    body apart), and a repair transcript piece by piece. With this project's own tokenizer both are
    encode(whole)."""
    hf_tok = load_tokenizer(tok_files["digits"][0], eos=0)
    own = own_tokenizer()
    train = tasks.generate_tasks("train", 20, seed=0)
    apart = lambda tok, t: tok.encode(env.render_prompt(t)) + tok.encode(t.solution)
    assert any(hf_tok.encode(env.corpus_text(t)) != apart(hf_tok, t) for t in train), \
        "this tokenizer should lack the prefix property"
    model = GPT(GPTConfig(vocab_size=800, seq_len=512, n_layer=1, n_embd=64, n_head=4, n_kv_head=2,
                          n_expert=1, top_k=1, n_shared_expert=0, expert_hidden=64))
    for tok in (hf_tok, own):
        prompts, _ = env.encode_prompts(model, tok, train, 64)
        for t, prompt in zip(train, prompts):
            ids = corpus.encode_doc(tok, repair.task_doc(t))
            assert ids == prompt + tok.encode(t.solution)
            if tok is own:
                assert ids == tok.encode(env.corpus_text(t))
    t, wrong = train[0], "    return 0\n"
    doc = repair.Transcript(env.render_episode(t, [(wrong, "# Test failed: f(1)\n"), (t.solution, "")]))
    a = len(env.render_prompt(t))
    doc.context, doc.cuts = (a, a + len(wrong) + len("# Test failed: f(1)\n")), (a + len(wrong),)
    V = hf_tok.vocab_size
    context = hf_tok.encode(wrong) + hf_tok.encode("# Test failed: f(1)\n")
    assert corpus.encode_doc(hf_tok, doc) == \
        hf_tok.encode(env.render_prompt(t)) + [i + V for i in context] + hf_tok.encode(t.solution)


# ---------------------------------------------------------------------------------------------
# The plan of granite-3.0-1b-a400m from its config.json alone

def test_granite_config_sizes_as_published():
    """docs/granite-3.0-1b-a400m/config.json (the published architecture; see docs/gpu.md) read as a
    GPTConfig: 1.3B parameters, 0.4B active per token, as IBM gives them."""
    cfg, raw = hf.read_config(os.path.join(ROOT, "docs", "granite-3.0-1b-a400m"))
    total, active, _ = plan.model_plan(cfg)
    assert raw["model_type"] == "granitemoe" and (cfg.n_expert, cfg.top_k) == (32, 8)
    assert 1.30e9 < total < 1.36e9 and 0.40e9 < active < 0.45e9


@pytest.mark.slow
def test_dry_run_plans_granite_from_its_config_json():
    for script, extra in [("train_pretrain.py", ["--seq-len", "1024", "--micro-batch", "8"]),
                          ("train_rl.py", ["--micro-batch", "16"])]:
        p = subprocess.run([sys.executable, script, "--preset", "gpu", "--dry-run", "--plan-device", "H100",
                            "--init-from", "docs/granite-3.0-1b-a400m", *extra],
                           cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        plan = json.loads(p.stdout.strip().splitlines()[-1])
        assert 1.30e9 < plan["params_total"] < 1.36e9 and plan["est_gpu_mem_gb"] < 0.9 * 80, plan


# ---------------------------------------------------------------------------------------------
# The recipe from a model directory, on the smoke preset

def run(args, timeout=900):
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, " ".join(args) + "\n" + p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "granitemoe"])
def test_smoke_recipe_from_a_model_directory(tmp_path, tok_files, arch):
    """A model directory -> continued pretraining -> RL with router replay -> eval, the agent's
    bootstrap (tool tokens: new rows) and MTP modules on the loaded MoE, and the RL checkpoint exported
    back to a directory that transformers loads with the same logits."""
    d = hf_model(arch, tmp_path / "base", std=0.02, stops=True)
    with open(tok_files[STYLE[arch]][0]) as src, open(os.path.join(d, "tokenizer.json"), "w") as dst:
        dst.write(src.read())
    out = str(tmp_path)
    # a small --lr: 4 steps at the preset's 3e-3 wear off ends_often's stops (every sample then runs to
    # the token limit, every group has one length and one reward, and nothing trains)
    cpt = run(["train_pretrain.py", "--preset", "smoke", "--init-from", d, "--seq-len", "128",
               "--max-steps", "4", "--lr", "1e-4", "--out-dir", f"{out}/cpt"])
    assert cpt["steps"] == 4 and cpt["val_bpb"] > 0
    # --len-penalty: rewards that differ within a group although no random model passes, so steps train
    rl = run(["train_rl.py", "--preset", "smoke", "--init-from", cpt["ckpt"], "--steps", "2", "--len-penalty",
              "0.05", "--out-dir", f"{out}/rl"])
    rows = [json.loads(line) for line in open(f"{out}/rl/metrics.jsonl") if '"logp_mismatch"' in line]
    assert rl["steps"] == 2 and len(rows) == 2 and all(r["trained_seqs"] > 0 for r in rows), rows
    assert all(r["logp_mismatch"] < 1e-3 for r in rows), rows    # router replay: trained as sampled
    ev = run(["eval.py", "--preset", "smoke", "--ckpt", d, "--ckpt", rl["ckpt"], "--out-dir", f"{out}/eval"])
    assert len(ev["checkpoints"]) == 2
    mtp = run(["train_mtp.py", "--preset", "smoke", "--init-from", cpt["ckpt"], "--out-dir", f"{out}/mtp"])
    assert 0 <= mtp["mtp_top1_agreement"][0] <= 1
    boot = run(["train_pretrain.py", "--preset", "smoke", "--init-from", d, "--mix",
                "stdlib=0.05,tasks=0.25,agent=0.7", "--agent-n", "20", "--task-difficulties", "1-2",
                "--seq-len", "256", "--max-steps", "2", "--out-dir", f"{out}/boot"])
    model, tok, _ = hf.load_checkpoint(boot["ckpt"])
    assert tok.tools and model.config.vocab_size == 700 + len(TOOL_TOKENS)
    model, tok, _ = hf.load_checkpoint(rl["ckpt"])
    exported = run(["hf.py", "export", rl["ckpt"], "--out-dir", f"{out}/hf"])     # the script itself
    assert exported["model_type"] == arch and exported["out_dir"] == f"{out}/hf"
    x = torch.randint(0, 700, (2, 12))
    assert (model(x)[0] - transformers_logits(f"{out}/hf", x)).abs().max() <= 1e-4
