"""docs/walkthrough.md quotes whole functions of the project; each quote must be the function exactly
as it stands in its file, so that a changed function fails here until the walkthrough is updated
(`python tests/test_walkthrough.py --update` rewrites every quote from the code; then reread the
prose around the ones that changed). python -m pytest tests/test_walkthrough.py -q"""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "walkthrough.md")
# a quote: the marker line, then one fenced python block
QUOTE = re.compile(r"<!-- quote: (?P<file>\S+) (?P<name>[\w.]+) -->\n```python\n(?P<code>.*?)```\n", re.S)
MAX_LINES = 760   # the walkthrough's budget of quoted code: about 750 lines


def source_of(path, qualname):
    """The source of function (or method) `qualname` in `path`, with its decorators, dedented to
    column 0: read with ast, never imported (train_pretrain.py is a script)."""
    text = open(os.path.join(ROOT, path)).read()
    tree, parts = ast.parse(text), qualname.split(".")
    nodes = tree.body
    for i, part in enumerate(parts):
        node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        assert node is not None, f"{path}: no {qualname}"
        nodes = node.body
    lines = text.splitlines(keepends=True)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    block = lines[start:node.end_lineno]
    indent = len(block[0]) - len(block[0].lstrip())
    return "".join(x[indent:] if x.strip() else x.lstrip(" ") for x in block)


def quotes(text=None):
    return list(QUOTE.finditer(open(DOC).read() if text is None else text))


def stale(text):
    """The quotes in `text` that differ from their function's source."""
    return [f"{m['file']} {m['name']}" for m in quotes(text) if m["code"] != source_of(m["file"], m["name"])]


def test_every_quote_is_the_function_as_it_stands():
    assert len(quotes()) >= 20, "the walkthrough quotes the reading path function by function"
    assert not stale(open(DOC).read()), "changed since docs/walkthrough.md quoted them (python tests/test_walkthrough.py --update)"


def test_the_reading_path_is_covered_within_its_budget():
    names = {f"{m['file']} {m['name']}" for m in quotes()}
    for must in ("model.py GPT.forward", "model.py MoE.forward", "model.py MoE.experts", "sampling.py reference",
                 "train_pretrain.py train_step", "train_rl.py rl_step", "train_rl.py sample_round",
                 "rl/rollouts.py rewards", "rl/algo.py group_advantages", "rl/algo.py ppo_token_loss",
                 "train_rl.py micro_batch_loss", "sandbox.py SandboxPool.submit_batch", "rl/algo.py pass_at_k"):
        assert must in names, must
    total = sum(m["code"].count("\n") for m in quotes())
    assert total <= MAX_LINES, f"{total} quoted lines"


def test_a_changed_function_fails():
    """The check itself: one character changed in a quote (as if its function had changed) is caught,
    and so is a quote of a function that no longer exists."""
    text = open(DOC).read()
    m = quotes(text)[0]
    edited = text[:m.start("code")] + m["code"].replace("(", "( ", 1) + text[m.end("code"):]
    assert stale(edited) == [f"{m['file']} {m['name']}"]
    gone = text.replace(f"<!-- quote: {m['file']} {m['name']} -->", f"<!-- quote: {m['file']} no_such_function -->", 1)
    try:
        stale(gone)
    except AssertionError as e:
        assert "no no_such_function" in str(e)
    else:
        raise AssertionError("a quote of a missing function passed")


def update():
    text = open(DOC).read()
    new = QUOTE.sub(lambda m: f"<!-- quote: {m['file']} {m['name']} -->\n```python\n"
                              f"{source_of(m['file'], m['name'])}```\n", text)
    open(DOC, "w").write(new)
    print(f"{len(quotes())} quotes, {sum(m['code'].count(chr(10)) for m in quotes())} lines")


if __name__ == "__main__" and "--update" in sys.argv:
    update()
