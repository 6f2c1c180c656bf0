"""tasks.py: the synthetic tasks are pure functions of their seed, correct, varied, and each split
holds only its own questions (the code task's reference solutions pass their own tests:
tests/test_sandbox.py, through the sandbox)."""
import json
import re

import pytest

import tasks


def test_make_arith_deterministic_and_correct():
    a = tasks.make_arith(2000, seed=3)
    assert a == tasks.make_arith(2000, seed=3) and a[:100] == tasks.make_arith(100, seed=3)
    assert a != tasks.make_arith(2000, seed=4)
    pattern = re.compile(r"(\w+) has (\d+) (\w+)\. (She|He) (.+?) (\d+)( more)?\. How many (\w+) now\?")
    ops, verbs = set(), set()
    for r in a:
        m = pattern.fullmatch(r["question"])
        assert m and m[3] == m[8], r["question"]
        x, y, c = int(m[2]), int(m[6]), int(r["target"])
        op = "+" if m[7] else "-"
        assert r["solution"] == f" {x} {op} {y} = {c}. The answer is {c}."
        assert c == (x + y if op == "+" else x - y) and c >= 0 and 1 <= x <= 99 and 1 <= y <= 99
        ops.add(op)
        verbs.add(m[5])
    assert ops == {"+", "-"} and len(verbs) == 8
    assert len({r["question"].split()[0] for r in a}) == 10 and len({r["question"].split()[3] for r in a}) == 10


def test_make_arith_digits_and_splits():
    evals = tasks.make_arith(300, seed=0, min_digits=2, max_digits=2, split="test")
    for r in evals:
        x, y = map(int, re.findall(r"\d+", r["question"]))
        assert 10 <= x <= 99 and 10 <= y <= 99
    train = tasks.make_arith(3000, seed=0, min_digits=2, max_digits=2, split="train")
    assert len(train) == 3000 and not {r["question"] for r in evals} & {r["question"] for r in train}
    # the same seed, any digits and set size: a test question never lands in train
    # (the split is the text's)
    wide = tasks.make_arith(3000, seed=0, min_digits=1, max_digits=3, split="train")
    assert not {r["question"] for r in evals} & {r["question"] for r in wide}
    anyq = tasks.make_arith(16_000, seed=1)
    share = {k: sum(tasks.split_of(r["question"]) == k for r in anyq) / len(anyq)
             for k in tasks.SPLITS}
    # each split's share of the questions drawn, within 4 standard errors
    for k, parts in tasks.SPLITS.items():
        p = parts / sum(tasks.SPLITS.values())
        assert abs(share[k] - p) < 4 * (p * (1 - p) / len(anyq)) ** 0.5, share
    with pytest.raises(ValueError, match="unknown split 'nope': one of test, dev, train"):
        tasks.make_arith(5, seed=0, max_digits=1, split="nope")


def test_make_code_deterministic_disjoint_and_not_constant():
    problems = tasks.make_code(60, seed=3)
    assert tasks.make_code(20, seed=3) == problems[:20]
    test = tasks.make_code(60, seed=3, split="test")
    train = tasks.make_code(1000, seed=4, split="train")
    for p in train:  # no constant passes all of a problem's tests
        assert len({json.dumps(want) for _, want in json.loads(p["target"])["tests"]}) > 1, p
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    assert len({p["question"].split(" that ")[1].split(".")[0].split(" ")[1] for p in problems}) > 5
