"""Reward functions for RL post-training: the callables a researcher reads, edits and adds to.

Contract: a reward is any picklable callable
`reward(prompt: str, response: str, target: str) -> float` (a class with `__call__`, so it can
travel to a worker process). Provided:

- MathReward: extract the final answer, compare it with `target`. Extraction order, first hit wins:
  1. the last `\\boxed{...}` / `\\fbox{...}` (nested braces);  2. GSM8K's `#### N`;
  3. "the answer is N";  4. the last number in the text (`last_number=False` turns this off).
  Comparison: equal strings (spaces ignored); else exact numbers (Fraction), reading thousands
  separators, `$`, `%`, trailing units and periods, signs, `3/4`, `\\frac{3}{4}`, `\\dfrac`,
  `1.5e3`, `1.5\\times10^{3}` (integers must match exactly, other numbers within `rel_tol`); else,
  when a side is not a plain number, symbolically with math-verify (sympy). `require_boxed` accepts
  only boxed answers; `partial_credit` is paid when the final answer is wrong (or unboxed where a
  box is required) but the target number appears in the response (torchforge's rule).
- ThinkingReward: 1.0 for a non-empty `<think>...</think>`, `partial_credit` for a malformed try.
- FormatReward: 1.0 if a regex matches.  WeightedReward: sum_k w_k * r_k as one reward.
- CodeReward: the response's last fenced Python block, run in the sandbox (sandbox.py) against the
  problem's tests; the fraction of tests passed, or 1.0 only when all pass. The target is JSON
  {"fn": name, "tests": [[args, expected], ...]}; the program is called with the args and never sees
  the expected outputs.

Cheap by construction (a reward runs B*G times a step): only the last `tail_chars` (8 KB) of a
response are read, braces are matched in one linear pass, no regex can backtrack badly, number
tokens longer than 400 characters are refused (int() of 100k digits is slow) and exponents have at
most 4 digits. The symbolic fallback (sympy can spin on `10^{10^{10^{10}}}`) runs only on short
strings without exponent towers or factorials, and under reward_guard.time_limit (without a timer,
e.g. in a thread, it is skipped rather than run unbounded). Whatever a reward still does wrong
(raise, hang, return NaN) is reward_guard.py's business: the trainer calls every reward through it.
Left out: LLM judges, multiple-choice and string-answer heuristics.
"""

import functools
import json
import math
import re
from decimal import Decimal
from fractions import Fraction

import torch

import config
from reward_guard import RewardTimeout, enclosing_expired, safe_call, score_batch, time_limit


# ---- numbers: text -> Fraction | None, with linear-time regexes ----------------------------------
_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # 1,234,567 or 1234567; "1,2" is two numbers
_NUM = rf"(?:(?<![\w)\]}}])[-+])?(?:{_INT}(?:\.\d*)?|\.\d+)"  # the "-" of "5-7" is not a sign
_NUMBER_RE = re.compile(rf"({_NUM})(?:\s*/\s*({_NUM}))?"
                        rf"(?:\s*(?:[eE]|(?:\\times|\\cdot|\*|×)\s*10\s*\^)"
                        rf"\s*([-+]?\d{{1,4}})(?!\d))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]{1,60})\}\s*\{\s*([^{}]{1,60})\}"
                      r"|\\[dt]?frac\s*(\d)\s*(\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_NOISE_RE = re.compile(r"\\[$%!,;: ]|\\left|\\right|\\displaystyle|[$%{}~]|\^\s*\\circ|\\circ|°")


def _clean(s):
    s = _TEXT_RE.sub(r" \1", s.replace("−", "-"))
    s = _FRAC_RE.sub(lambda m: f"({m[1] or m[3]})/({m[2] or m[4]})", s)
    s = re.sub(r"\(\s*([-+]?[\d.,]+)\s*\)", r"\1", s)  # (3)/(4) -> 3/4, but (1+2)/(4) stays
    return _NOISE_RE.sub("", s).strip()


def _fraction(num, den, exp):
    if len(num) + len(den or "") > 400:  # refuse huge tokens: int() of 100k digits is slow
        return None
    x = Fraction(Decimal(num.replace(",", "")))
    d = Fraction(Decimal(den.replace(",", ""))) if den else 1
    return None if d == 0 else x / d * Fraction(10) ** int(exp or 0)


def to_number(s, strict=True):
    """The number `s` states. strict: all of `s` (right of an `=`; units allowed); else its first
    number."""
    s = _clean(s)
    if strict and "=" in s:
        s = s.rsplit("=", 1)[1].strip()
    m = _NUMBER_RE.match(s) if strict else _NUMBER_RE.search(s)
    if m is None:
        return None
    rest = re.sub(r"\^\s*[23]|[²³]", "", s[m.end():])  # cm^2, m³ are units, not digits
    if strict and re.search(r"[\d+\-*/^=<>(\\]", rest):  # "3+4", "2\sqrt{2}": not a plain number
        return None
    return _fraction(*m.groups())


def _close(a, b, rel_tol):  # integers exactly (1450001 != 1450000), anything else within rel_tol
    return (a == b if a.denominator == b.denominator == 1
            else abs(a - b) <= Fraction(rel_tol) * max(abs(b), 1))


# ---- answer extraction ---------------------------------------------------------------------------
def last_boxed(text):
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces); None if absent or
    unclosed."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    j = text.find("{", i)
    if i < 0 or j < 0 or text[i:j].strip() not in ("\\boxed", "\\fbox"):
        m = re.match(r"\\boxed\s+([^\s$]{1,100})", text[max(i, 0):])  # "\boxed 5"
        return m[1] if i >= 0 and m else None
    depth = 0
    for m in re.finditer(r"[{}]", text[j:]):  # one linear pass; only the last box is tried
        depth += 1 if m[0] == "{" else -1
        if depth == 0:
            return text[j + 1 : j + m.start()]
    return None


def extract_answer(text, last_number=True):
    """-> (answer, how), how in boxed | hash | answer_is | last_number; (None, None) if nothing."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    for pattern, how in ((r"####[ \t]*([^\n]{0,100})", "hash"),
                         (r"(?i:answer is)[ \t:]*([^\n]{0,100})", "answer_is")):
        hits = re.findall(pattern, text)
        if hits:
            return hits[-1], how
    hits = _NUMBER_RE.findall(text) if last_number else None
    if hits:
        num, den, exp = hits[-1]
        return num + (f"/{den}" if den else "") + (f"e{exp}" if exp else ""), "last_number"
    return None, None


# short, no exponent towers, no 4-digit exponents, no factorials or huge literals
def _sympy_safe(s):
    return (len(s) <= 100 and "!" not in s and "\\binom" not in s
            and not re.search(r"\^\s*\{?[^}]{0,20}\^|\^\s*\{?\s*-?\d{4}|\d{25}", s))


def _load_math_verify():  # call outside any time limit: the first sympy import takes ~1 s
    try:
        import math_verify
        return math_verify
    except ImportError:
        return None


class MathReward:
    def __init__(self, require_boxed=False, last_number=True, partial_credit=0.0, rel_tol=1e-6,
                 symbolic=True, symbolic_timeout_s=0.5, tail_chars=8192):
        self.require_boxed, self.last_number, self.partial_credit = (
            require_boxed, last_number, partial_credit)
        self.rel_tol, self.symbolic, self.symbolic_timeout_s = rel_tol, symbolic, symbolic_timeout_s
        self.tail_chars = tail_chars
        if symbolic:
            _load_math_verify()

    # unpickled in a RewardPool worker: import sympy before any timed call
    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.symbolic:
            _load_math_verify()

    def __call__(self, prompt, response, target):
        try:
            return self._score(response[-self.tail_chars:], str(target))
        except Exception:  # a parser bug costs one sample, never the run
            return 0.0

    def _score(self, text, target):
        answer, how = extract_answer(text, self.last_number)
        if answer is not None and (how == "boxed" or not self.require_boxed):
            if self.equal(answer, target, strict=how in ("boxed", "last_number")):
                return 1.0
        if self.partial_credit and (b := to_number(target)) is not None:
            if any((a := _fraction(*g)) is not None and _close(a, b, self.rel_tol)
                   for g in _NUMBER_RE.findall(text)):
                return self.partial_credit
        return 0.0

    def equal(self, answer, target, strict=True):
        answer, target = answer.strip().rstrip("."), target.strip()
        if re.sub(r"\s+", "", answer) == re.sub(r"\s+", "", target):
            return True
        a, b = to_number(answer, strict), to_number(target)
        if a is not None and b is not None:
            return _close(a, b, self.rel_tol)
        mv = self.symbolic and _sympy_safe(answer) and _sympy_safe(target) and _load_math_verify()
        if not mv:
            return False
        try:
            with time_limit(self.symbolic_timeout_s) as deadline:
                if deadline == math.inf:  # no timer off the main thread: never run sympy unbounded
                    return False
                gold = mv.parse(f"\\boxed{{{target}}}", parsing_timeout=None)
                pred = mv.parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
                return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=None))
        except RewardTimeout as e:
            if enclosing_expired(e):  # an enclosing limit (safe_call's) expired: not ours to eat
                raise
            return False
        except Exception:
            return False


class ThinkingReward:
    """1.0 if `<tag>`...`</tag>` holds non-space text (the opening tag may end the prompt, as in
    chat templates that open the block); `partial_credit` for another attempt (unclosed, empty,
    `< Think >`)."""

    def __init__(self, tag="think", partial_credit=0.2):
        self.tag, self.partial_credit = tag, partial_credit
        self.attempt_re = re.compile(rf"<\s{{0,3}}/?\s{{0,3}}{re.escape(tag)}\s{{0,3}}>",
                                     re.IGNORECASE)

    def __call__(self, prompt, response, target):
        open_, close = f"<{self.tag}>", f"</{self.tag}>"
        i = response.find(open_)
        start = i + len(open_) if i >= 0 else (0 if prompt.rstrip().endswith(open_) else -1)
        end = response.find(close, start) if start >= 0 else -1
        if end >= 0 and response[start:end].strip():
            return 1.0
        return self.partial_credit if self.attempt_re.search(response) else 0.0


class FormatReward:
    """1.0 if re.search(pattern) finds the response (anchor it for a whole-response format); a
    response longer than `max_chars` scores 0.0, which bounds any sane pattern's time."""

    def __init__(self, pattern, flags=re.DOTALL, max_chars=20000):
        self.regex, self.max_chars = re.compile(pattern, flags), max_chars

    def __call__(self, prompt, response, target):
        return float(len(response) <= self.max_chars and self.regex.search(response) is not None)


class WeightedReward:
    """sum_k weights[k] * fns[k](...) as one reward; each term through safe_call (a failure adds
    0.0)."""

    def __init__(self, fns, weights=None, timeout_s=1.0):
        self.fns, self.weights, self.timeout_s = fns, weights or {}, timeout_s

    def __call__(self, prompt, response, target):
        return sum(self.weights.get(k, 1.0)
                   * safe_call(fn, prompt, response, target, self.timeout_s)[0]
                   for k, fn in self.fns.items())


_FENCE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class CodeReward:
    """Tests passed by the last ```python block (`mode` "fraction" or "all"); no block scores 0.0
    without running anything. `fenced=False` runs the whole response (for raw-code completions).
    Each response is one sandbox run of at most `timeout_s` (keep rollout.reward_timeout_s above it:
    the run's start-up adds ~0.1 s)."""

    def __init__(self, mode="fraction", timeout_s=1.0, memory_mb=256, fenced=True):
        assert mode in ("fraction", "all"), mode
        self.mode, self.timeout_s, self.memory_mb, self.fenced = mode, timeout_s, memory_mb, fenced

    def __call__(self, prompt, response, target):
        import sandbox  # here, not at the top: only code runs pay the isolation probe
        spec = json.loads(target)
        blocks = _FENCE_RE.findall(response) if self.fenced else [response]
        if not blocks:
            return 0.0
        got, _ = sandbox.call_tests(blocks[-1], spec["fn"], [args for args, _ in spec["tests"]],
                                    timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        passed = sum(g == want for g, (_, want) in zip(got or [], spec["tests"]))
        return (passed / len(spec["tests"]) if self.mode == "fraction"
                else float(passed == len(spec["tests"])))


# names for rollout.rewards
BUILTIN = {"math": MathReward, "think": ThinkingReward, "format": FormatReward,
           "code": CodeReward}


# --------------------------------------------------------------------------------------------------
# From `rollout.rewards` to a batch's rewards: the trainers' side (rollout.py scores each step with
# it)
# --------------------------------------------------------------------------------------------------
def reward_specs(entries, accuracy="math"):
    """`rollout.rewards` -> [(name, factory, kwargs, weight)]. A key is a built-in (BUILTIN) or
    "package.module:Name" / "path/to/file.py:Name" (a class, instantiated with the kwargs, or a
    function); a value is its weight, or {"weight": w, **kwargs}. `accuracy` ("math" unless
    rollout.accuracy says) is always there, with weight 0 unless listed: it is the accuracy metric
    whatever else is summed. Imports only (the config check); make_rewards instantiates."""
    specs = []
    for key, value in {**entries, accuracy: entries.get(accuracy, 0.0)}.items():
        kwargs = dict(value) if isinstance(value, dict) else {"weight": value}
        weight, field = kwargs.pop("weight", 1.0), f"rollout.rewards[{key!r}]"
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise config.ConfigError(f"{field}: the weight must be a number, got {weight!r}")
        fn = config.named(key, BUILTIN, field, "reward")
        specs.append((reward_name(key), fn, kwargs, float(weight)))
    return specs


def reward_name(key):
    """A reward's name in logs and in make_rewards' dicts: a built-in's own, a user's class or
    function name ("file.py:Name" -> "Name")."""
    return key if key in BUILTIN else key.rpartition(":")[2]


def make_rewards(ro):
    """({name: callable}, {name: weight}), each reward instantiated once, here (picklable for
    RewardPool)."""
    fns, weights = {}, {}
    for name, factory, kwargs, weight in reward_specs(ro.rewards, ro.accuracy):
        try:
            fns[name] = factory(**kwargs) if isinstance(factory, type) else \
                functools.partial(factory, **kwargs) if kwargs else factory
        except TypeError as e:  # wrong keyword arguments for the class
            raise config.ConfigError(f"rollout.rewards: {name}({kwargs}) failed: {e}") from None
        if not callable(fns[name]):
            raise config.ConfigError(
                f"rollout.rewards: a {name} instance is not callable (no __call__)")
        weights[name] = weight
    return fns, weights


def score(groups, problems, reward_fns, weights, ro, pool=None):
    """Rewards (B, G) of this rank's groups under the rollout section `ro`: the weighted total, the
    accuracy reward's part (correctness), and the reward stats."""
    prompts, responses, targets, ends = [], [], [], []
    for p, comps in zip(problems, groups):
        for c in comps:
            prompts.append(p["question"])
            # a multi-turn episode's last reply, against the env's target if it has one
            responses.append(c.text)
            targets.append(c.metadata.get("target") or str(p["target"]))
            ends.append((c.metadata.get("end"), c.metadata.get("env_reward")))
    acc = reward_name(ro.accuracy)
    total, stats, parts = score_batch(reward_fns, weights, prompts, responses, targets,
                                      timeout_s=ro.reward_timeout_s, pool=pool,
                                      per_reward=True)
    # an episode scores the env's reward plus the rewards on its last reply; an env error 0
    if ro.env:
        total = [0.0 if end == "error" else t + (env_r or 0.0)
                 for t, (end, env_r) in zip(total, ends)]
        parts[acc] = [0.0 if end == "error" else m for m, (end, _) in zip(parts[acc], ends)]
    view = lambda x: torch.tensor(x, dtype=torch.float32).view(len(groups), -1)  # noqa: E731
    return view(total), view(parts[acc]), stats
