"""The model-free search baseline (data/search.py): what it solves per kind within the agent's step limit,
that it decides from the issue and the observations alone, and that it is deterministic.
python -m pytest tests/test_search.py -q"""
import env
from data import search
from data.repos import KINDS, generate_repo_tasks

# two tasks of each kind, held-out seed 11 at the eval preset's levels (eval.py --agent: cpu)
TASKS = generate_repo_tasks("test", 8, seed=11, difficulties=[1, 2])


def per_kind(tasks, eps):
    return {k: sum(e.result.passed for t, e in zip(tasks, eps) if t.kind == k) /
            sum(t.kind == k for t in tasks) for k in KINDS}


def test_search_solves_every_kind_within_the_step_limit(pool):
    """Each task of the sample is solved within 12 actions, the submit included, by an edit the hidden tests
    accept; a trivial policy (run the tests, submit) solves none, so the judge gives nothing away."""
    eps = search.episodes(TASKS, env.Tools(), pool)
    assert per_kind(TASKS, eps) == dict.fromkeys(KINDS, 1.0)
    assert all(e.end == "submit" and len(e.actions) <= 12 and e.result.outcome == "pass" for e in eps)
    assert all(any(a.name == "edit" and not a.error for a in e.actions) for e in eps)

    def trivial(prompt, budget):
        yield "test", ""
        yield "submit", ""
    assert per_kind(TASKS, search.episodes(TASKS, env.Tools(), pool, trivial)) == dict.fromkeys(KINDS, 0.0)


def test_search_keeps_a_smaller_step_limit_and_is_deterministic(pool):
    """A tighter limit: the search still submits within it (an episode out of actions would fail), and
    the same tasks give the same episodes, action by action."""
    tight = search.episodes(TASKS, env.Tools(max_actions=4), pool)
    assert all(e.end == "submit" and len(e.actions) <= 4 for e in tight)
    actions = lambda eps: [[(a.name, a.path, a.function, a.error) for a in e.actions] for e in eps]
    assert actions(search.episodes(TASKS, env.Tools(), pool)) == actions(search.episodes(TASKS, env.Tools(), pool))


class IssueOnly:
    """A task as the agent's prompt shows it: the issue alone (env.Tools' prompt inlines no file). Any
    other field (files, fixed, targets, facts, inputs, outputs, ...) raises AttributeError."""
    __slots__ = ("issue",)

    def __init__(self, issue):
        self.issue = issue


def test_search_decides_from_the_issue_and_observations_only(pool):
    """The policy is built from the prompt of a task that holds only its issue, and stepped here with the
    observations of the real task's tools: it solves every task of the sample, with exactly the actions
    that eval's driver (search.episodes) takes. The hidden tests judge only the end."""
    tools = env.Tools()
    driven = search.episodes(TASKS, tools, pool)
    for t, d in zip(TASKS, driven):
        assert tools.prompt(IssueOnly(t.issue)) == tools.prompt(t)
        policy = search.search(tools.prompt(IssueOnly(t.issue)), tools.max_actions)
        e, obs = env.Episode(0), None
        tools.start(t, e)
        while True:
            name, payload = policy.send(obs)
            act = env.Action(name)
            e.actions.append(act)
            if name == "submit":
                break
            try:
                obs, run = tools.apply(t, e, name, payload, act)
            except ValueError as err:
                act.error, obs, run = "tool", str(err), None
            if run:
                r = pool.run_batch([run])[0]
                obs = env.test_report(r, [n for n, in run.inputs]) if name == "test" else env.run_report(r)
        assert [(a.name, a.path, a.function) for a in e.actions] == [(a.name, a.path, a.function)
                                                                     for a in d.actions]
        assert pool.run_batch([env.hidden_run(t, e.repo)])[0].passed, t.task_id
