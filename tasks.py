"""The synthetic tasks: problems drawn from a seed, with no download, for the CPU demos and the
tests.

- `make_arith`: the word problems the CPU demo learns from scratch
  (docs/demo.md#how-the-task-was-calibrated): "Sue has 11 eggs. She finds 65 more. How many eggs
  now?" -> " 11 + 65 = 76. The answer is 76." (target "76"). The tiny checkpoint's tokenizer is
  trained on them (data.make_tiny_tokenizer).
- `make_code`: one-line Python specs ("Write a Python function f(x) that returns 7 times x plus 3.")
  whose target holds tests the program never sees; rewards.CodeReward runs them in the sandbox.

Both return records {question, solution, target} like data.load_gsm8k's and are a pure function of
their arguments (the same seed, the same problems, on every rank and every resume). Which split a
question belongs to is a function of its text alone (`split_of`), so no trainer ever trains on a dev
or test question, whatever the seed, the digits or the size of the set that drew it.
"""
import json
import random

import seeds

# sixteenths of all questions: the held-out eval, SFT's stop, the rest
SPLITS = {"test": 1, "dev": 1, "train": 14}


def split_of(question: str) -> str:
    """"train", "dev" (SFT's stopping rule) or "test" (the held-out eval both trainers keep out of
    training): the one definition of the held-out problems, from the question's text and nothing
    else."""
    h = seeds.seed("split", question) % sum(SPLITS.values())  # the text alone: no seed, no digits
    return ("test" if h < SPLITS["test"] else "dev" if h < SPLITS["test"] + SPLITS["dev"]
            else "train")

def check_split(split):
    if split is not None and split not in SPLITS:
        raise ValueError(
            f"unknown split {split!r}: one of {', '.join(SPLITS)} (or None: any question)")


# --------------------------------------------------------------------------------------------------
# The synthetic arithmetic task (docs/demo.md#how-the-task-was-calibrated)
# --------------------------------------------------------------------------------------------------
NAMES = [("Sue", "She"), ("Tom", "He"), ("Ann", "She"), ("Bob", "He"), ("Mia", "She"),
         ("Sam", "He"), ("Eva", "She"), ("Max", "He"), ("Zoe", "She"), ("Leo", "He")]
OBJECTS = ["eggs", "apples", "books", "coins", "pens", "cards", "shells", "stamps", "cups", "balls"]
VERBS = {"+": ["finds {b} more", "buys {b} more", "gets {b} more", "wins {b} more"],
         "-": ["loses {b}", "gives away {b}", "sells {b}", "drops {b}"]}


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    d = rng.randint(min_digits, max_digits)
    return rng.randint(1 if d == 1 else 10 ** (d - 1), 10 ** d - 1)


def make_arith(n: int, seed: int, min_digits: int = 1, max_digits: int = 2,
               split: str | None = None) -> list[dict]:
    """n word problems {question, solution, target}, a pure function of the arguments. Operands have
    between min_digits and max_digits digits. `split`: only questions of that split (split_of);
    None: any.
    Prefix-stable: make_arith(n, s)[:k] == make_arith(k, s)."""
    assert 1 <= min_digits <= max_digits, (min_digits, max_digits)
    check_split(split)
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"could not draw {n} problems of split {split!r} ({len(out)} found)")
        (name, pron), obj = rng.choice(NAMES), rng.choice(OBJECTS)
        a, b = _operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits)
        op = rng.choice("+-")
        # drawn before the flip so the random stream does not depend on it
        verb = rng.choice(VERBS[op])
        if op == "-" and b > a:  # no negative counts: the problem becomes an addition
            op, verb = "+", VERBS["+"][VERBS["-"].index(verb)]
        c = a + b if op == "+" else a - b
        question = f"{name} has {a} {obj}. {pron} {verb.format(b=b)}. How many {obj} now?"
        if split is not None and split_of(question) != split:
            continue
        out.append({"question": question, "solution": f" {a} {op} {b} = {c}. The answer is {c}.",
                    "target": str(c)})
    return out


# The embedded code task: a one-line spec, a function f(x), tests the program never sees
# (rewards.CodeReward). Each spec: (text, reference, the solution's body, the input kind); a, b are
# drawn per problem.
CODE_SPECS = [
    ("returns {a} times x plus {b}", lambda a, b: lambda x: a * x + b, "{a} * x + {b}", "int"),
    ("returns x squared minus {b}", lambda a, b: lambda x: x * x - b, "x * x - {b}", "int"),
    ("returns x modulo {a} plus {b}", lambda a, b: lambda x: x % a + b, "x % {a} + {b}", "int"),
    ("returns the sum of the digits of the non-negative integer x",
     lambda a, b: lambda x: sum(map(int, str(x))), "sum(int(d) for d in str(x))", "int"),
    ("returns True if x is divisible by {a}, else False", lambda a, b: lambda x: x % a == 0,
     "x % {a} == 0", "int"),
    ("returns the largest number in the list x", lambda a, b: max, "max(x)", "list"),
    ("returns the list x reversed", lambda a, b: lambda x: x[::-1], "x[::-1]", "list"),
    ("returns the sum of the even numbers in the list x",
     lambda a, b: lambda x: sum(v for v in x if v % 2 == 0),
     "sum(v for v in x if v % 2 == 0)", "list"),
    ("returns how many numbers in the list x are greater than {a}",
     lambda a, b: lambda x: sum(v > a for v in x), "sum(v > {a} for v in x)", "list"),
    ("returns the list x with {b} added to every number", lambda a, b: lambda x: [v + b for v in x],
     "[v + {b} for v in x]", "list"),
    ("returns the list x with every number multiplied by {a}",
     lambda a, b: lambda x: [v * a for v in x], "[v * {a} for v in x]", "list"),
    ("returns the string x in upper case", lambda a, b: str.upper, "x.upper()", "str"),
    ("returns the string x repeated {a} times", lambda a, b: lambda x: x * a, "x * {a}", "str"),
    ("returns how many times the letter 'a' appears in the string x",
     lambda a, b: lambda x: x.count("a"), "x.count('a')", "str"),
]


def make_code(n: int, seed: int, tests: int = 4, split: str | None = None) -> list[dict]:
    """n problems {question, solution, target}; target = JSON {"fn": "f", "tests": [[[x], f(x)],
    ...]}. A pure function of the arguments, like make_arith; `split`: only questions of that split
    (split_of); None: any."""
    check_split(split)
    rng, out, tries = random.Random(seed), [], 0
    draw = {"int": lambda: rng.randint(0, 99),
            "list": lambda: [rng.randint(-9, 20) for _ in range(rng.randint(1, 6))],
            "str": lambda: "".join(rng.choice("abcdeab") for _ in range(rng.randint(1, 6)))}
    while len(out) < n:
        text, ref, body, kind = rng.choice(CODE_SPECS)
        a, b = rng.randint(2, 12), rng.randint(1, 99)
        question = (f"Write a Python function f(x) that {text.format(a=a, b=b)}. "
                    "Reply with the function in a ```python code block.")
        f = ref(a, b)
        for _ in range(20):  # tests that one constant answer would pass are redrawn
            inputs = [draw[kind]() for _ in range(tests)]
            if len({json.dumps(f(x)) for x in inputs}) > 1:
                break
        else:
            continue
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(
                f"could not draw {n} code problems of split {split!r} ({len(out)} found)")
        # a question may repeat within a split (new tests)
        if split is not None and split_of(question) != split:
            continue
        out.append({"question": question,
                    "solution": f"```python\ndef f(x):\n    return {body.format(a=a, b=b)}\n```",
                    "target": json.dumps({"fn": "f", "tests": [[[x], f(x)] for x in inputs]})})
    return out
