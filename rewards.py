"""Reward functions for RL post-training, and a guard that keeps a bad one from stopping the run.

Contract: a reward is any picklable callable `reward(prompt: str, response: str, target: str) -> float`
(a class with `__call__`, so it can be sent to a worker process). Rewards here:

- MathReward: extracts the final answer and compares it to `target`. Extraction order, first hit wins:
  1. the last `\\boxed{...}` (or `\\fbox{...}`), nested braces matched;  2. GSM8K's `#### N`;
  3. "the answer is N";  4. the last number in the text (`last_number=False` turns this off).
  Comparison: equal strings after removing spaces; else both sides as exact numbers (Fraction) with
  thousands separators, `$`, `%`, trailing units/periods, `-`, `3/4`, `\\frac{3}{4}`, `\\dfrac`, `1.5e3`,
  `1.5\\times10^{3}` understood, equal within `rel_tol`; else, if either side is not a plain number,
  symbolically with math-verify (sympy).  `require_boxed=True` accepts only boxed answers;
  `partial_credit` is paid when the final answer is wrong (or not boxed when that is required) but
  the target number appears somewhere in the response (torchforge's rule).
- ThinkingReward: 1.0 for a non-empty `<think>...</think>` block, `partial_credit` for a malformed try.
- FormatReward: 1.0 if a regex matches the response.  WeightedReward: sum_k w_k * r_k.

Safety model (why a reward can neither crash nor stall the trainer):
- Extractors are cheap by construction: they look only at the last `tail_chars` (8 KB) of a response,
  scan braces in linear time, use no regex that can backtrack badly, refuse number tokens longer
  than 400 characters (int() of 100k digits is slow), and cap exponents at 4 digits.
- The symbolic fallback (sympy can hang on `10^{10^{10^{10}}}`) runs only on short strings without
  exponent towers, big exponents or factorials, and under `time_limit` (SIGALRM + setitimer).
- `score_batch` calls every reward through `safe_call`: an exception, a None/NaN/inf result or a call
  past `timeout_s` scores 0.0 and is counted per reward (`rewards/<name>_errors|_timeouts|_nonfinite`).
  In-process, the time limit is a signal (main thread only: elsewhere a call is only measured,
  scored 0.0 if late) and cannot interrupt one long C call (e.g. a catastrophic `re` match).
  `RewardPool` runs rewards in spawned worker processes: each worker applies the same signal limit,
  and a worker still busy `kill_grace_s` after its limit is killed and replaced, so even a C-level
  hang costs one sample, not the run.
Left out: code-execution rewards, LLM judges, answer-format heuristics beyond the list above.
"""
import math
import multiprocessing as mp
import re
import signal
import threading
import time
from contextlib import contextmanager
from decimal import Decimal
from fractions import Fraction
from multiprocessing.connection import wait


class RewardTimeout(BaseException):  # BaseException: a reward's own `except Exception` cannot swallow it
    def __init__(self, deadline):
        super().__init__(deadline)
        self.deadline = deadline


_deadlines = []  # absolute monotonic deadlines of the active (nested) time_limit blocks, main thread


def _on_alarm(signum, frame):
    raise RewardTimeout(min(_deadlines, default=0.0))


def _arm():
    signal.setitimer(signal.ITIMER_REAL, max(min(_deadlines) - time.monotonic(), 1e-4))


@contextmanager
def time_limit(seconds):
    """Raise RewardTimeout(deadline) in this block after `seconds`; nests; a no-op off the main thread."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield math.inf
        return
    if not _deadlines:  # outermost: keep whoever else uses SIGALRM (pytest-timeout) working afterwards
        saved = signal.signal(signal.SIGALRM, _on_alarm), signal.getitimer(signal.ITIMER_REAL)[0]
        t0 = time.monotonic()
    deadline = time.monotonic() + seconds
    _deadlines.append(deadline)
    try:
        _arm()
        yield deadline
    finally:
        try:  # the alarm may fire right here; the inner finally still restores the state
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            _deadlines.remove(deadline)
            if _deadlines:
                _arm()
            else:
                signal.signal(signal.SIGALRM, saved[0])
                if saved[1]:
                    signal.setitimer(signal.ITIMER_REAL, max(saved[1] - (time.monotonic() - t0), 1e-4))


def safe_call(fn, prompt, response, target, timeout_s=1.0):
    """-> (score, status), status in ok | error | timeout | nonfinite; never raises, 0.0 on failure."""
    t0 = time.monotonic()
    try:
        with time_limit(timeout_s):
            value = fn(prompt, response, target)
    except RewardTimeout:
        return 0.0, "timeout"
    except Exception:
        return 0.0, "error"
    if timeout_s and time.monotonic() - t0 > timeout_s:  # off the main thread, or a long C call
        return 0.0, "timeout"
    try:
        value = float(value)
    except TypeError:
        return 0.0, ("nonfinite" if value is None else "error")
    except Exception:
        return 0.0, "error"
    return (value, "ok") if math.isfinite(value) else (0.0, "nonfinite")


# ---- number parsing: `text -> Fraction | None`, linear-time regexes on short strings -------------
_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # 1,234,567 or 1234567; "1,2" is not one number
_NUM = rf"[-+]?(?:{_INT}(?:\.\d*)?|\.\d+)"
_NUMBER_RE = re.compile(rf"({_NUM})(?:\s*/\s*({_NUM}))?(?:\s*(?:[eE]|(?:\\times|\\cdot|\*|×)\s*10\s*\^)\s*([-+]?\d{{1,4}})(?!\d))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]{1,60})\}\s*\{\s*([^{}]{1,60})\}|\\[dt]?frac\s*(\d)\s*(\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_NOISE_RE = re.compile(r"\\[$%!,;: ]|\\left|\\right|\\displaystyle|[$%{}~]|\^\s*\\circ|\\circ|°")


def _clean(s):
    s = _TEXT_RE.sub(r" \1", s.replace("−", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac"))
    s = _FRAC_RE.sub(lambda m: f"({m[1] or m[3]})/({m[2] or m[4]})", s)
    s = re.sub(r"\(\s*([-+]?[\d.,]+)\s*\)", r"\1", s)  # (3)/(4) -> 3/4, but (1+2)/(4) stays
    return _NOISE_RE.sub("", s).strip()


def _fraction(num, den, exp):
    if len(num) + len(den or "") > 400:  # int() of 100k digits is slow (and refused past 4300)
        return None
    x = Fraction(Decimal(num.replace(",", "")))
    if den:
        d = Fraction(Decimal(den.replace(",", "")))
        x = x / d if d else None
    return x * Fraction(10) ** int(exp) if x is not None and exp else x


def to_number(s, strict=True):
    """The number `s` states. strict: all of `s` (after `=`, units allowed); else its first number."""
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
    if a.denominator == b.denominator == 1:
        return a == b
    return abs(a - b) <= Fraction(rel_tol) * max(abs(b), 1)


# ---- answer extraction --------------------------------------------------------------------------
def last_boxed(text):
    """Content of the last \\boxed{...}/\\fbox{...} (nested braces), None if absent or unclosed."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0 or text[i:j].strip() not in ("\\boxed", "\\fbox"):
        m = re.match(r"\\boxed\s+([^\s$]{1,100})", text[i:])  # "\boxed 5"
        return m[1] if m else None
    depth = 0
    for m in re.finditer(r"[{}]", text[j:]):
        depth += 1 if m[0] == "{" else -1
        if depth == 0:
            return text[j + 1 : j + m.start()]
    return None


def extract_answer(text, last_number=True):
    """-> (answer string, how) with how in boxed | hash | answer_is | last_number, or (None, None)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    hits = list(re.finditer(r"####[ \t]*([^\n]{0,100})", text))
    if hits:
        return hits[-1][1], "hash"
    hits = list(re.finditer(r"answer is[ \t:]*([^\n]{0,100})", text, re.IGNORECASE))
    if hits:
        return hits[-1][1], "answer_is"
    if last_number:
        hits = _NUMBER_RE.findall(text)
        if hits:
            num, den, exp = hits[-1]
            return num + (f"/{den}" if den else "") + (f"e{exp}" if exp else ""), "last_number"
    return None, None


def _sympy_safe(s):
    """Inputs sympy handles fast: short, no exponent towers/big exponents, no factorials."""
    return (len(s) <= 100 and "!" not in s and "\\binom" not in s
            and not re.search(r"\^\s*\{?[^}]{0,20}\^|\^\s*\{?\s*-?\d{4}|\d{25}", s))


def _load_math_verify():
    try:
        import math_verify  # imported outside any time limit: the first sympy import takes ~1 s
        return math_verify
    except ImportError:
        return None


class MathReward:
    def __init__(self, require_boxed=False, last_number=True, partial_credit=0.0, rel_tol=1e-6,
                 symbolic=True, symbolic_timeout_s=0.5, tail_chars=8192):
        self.require_boxed, self.last_number, self.partial_credit = require_boxed, last_number, partial_credit
        self.rel_tol, self.symbolic, self.symbolic_timeout_s = rel_tol, symbolic, symbolic_timeout_s
        self.tail_chars = tail_chars
        if symbolic:
            _load_math_verify()

    def __call__(self, prompt, response, target):
        try:
            return self._score(response[-self.tail_chars:], str(target))
        except Exception:  # a parser bug must cost one sample, never the run
            return 0.0

    def _score(self, text, target):
        answer, how = extract_answer(text, self.last_number)
        if answer is not None and (how == "boxed" or not self.require_boxed):
            if self.equal(answer, target, strict=how in ("boxed", "last_number")):
                return 1.0
        if self.partial_credit and (b := to_number(target)) is not None:
            for num, den, exp in _NUMBER_RE.findall(text):
                a = _fraction(num, den, exp)
                if a is not None and _close(a, b, self.rel_tol):
                    return self.partial_credit
        return 0.0

    def equal(self, answer, target, strict=True):
        answer, target = answer.strip().rstrip("."), target.strip()
        if re.sub(r"\s+", "", answer) == re.sub(r"\s+", "", target):
            return True
        a, b = to_number(answer, strict), to_number(target)
        if a is not None and b is not None:
            return _close(a, b, self.rel_tol)
        if not (self.symbolic and _sympy_safe(answer) and _sympy_safe(target)):
            return False
        mv = _load_math_verify()
        if mv is None:
            return False
        try:
            with time_limit(self.symbolic_timeout_s):
                gold = mv.parse(f"\\boxed{{{target}}}", parsing_timeout=None)
                pred = mv.parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
                return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=None))
        except RewardTimeout as e:
            if e.deadline in _deadlines:  # an enclosing limit (safe_call's) expired: not ours to eat
                raise
            return False
        except Exception:
            return False


class ThinkingReward:
    """1.0 if `<tag>` ... `</tag>` holds non-space text (or the prompt ends with `<tag>`, as chat
    templates that open the block do, and the response closes it); `partial_credit` for any other
    attempt (unclosed, empty, `< Think >`); 0.0 without one."""

    def __init__(self, tag="think", partial_credit=0.2):
        self.tag, self.partial_credit = tag, partial_credit
        self.attempt_re = re.compile(rf"<\s{{0,3}}/?\s{{0,3}}{re.escape(tag)}\s{{0,3}}>", re.IGNORECASE)

    def __call__(self, prompt, response, target):
        open_, close = f"<{self.tag}>", f"</{self.tag}>"
        i = response.find(open_)
        start = i + len(open_) if i >= 0 else (0 if prompt.rstrip().endswith(open_) else -1)
        end = response.find(close, start) if start >= 0 else -1
        if end >= 0 and response[start:end].strip():
            return 1.0
        return self.partial_credit if self.attempt_re.search(response) else 0.0


class FormatReward:
    """1.0 if `pattern` is found in the response (re.search; anchor it for a whole-response format).
    Responses longer than `max_chars` score 0.0, which bounds the time of any sane pattern."""

    def __init__(self, pattern, flags=re.DOTALL, max_chars=20000):
        self.regex, self.max_chars = re.compile(pattern, flags), max_chars

    def __call__(self, prompt, response, target):
        return float(len(response) <= self.max_chars and self.regex.search(response) is not None)


class WeightedReward:
    """sum_k weights[k] * fns[k](...), each term through safe_call (a failing term adds 0.0)."""

    def __init__(self, fns, weights=None, timeout_s=1.0):
        self.fns, self.weights, self.timeout_s = fns, weights or {}, timeout_s

    def __call__(self, prompt, response, target):
        return sum(self.weights.get(name, 1.0) * safe_call(fn, prompt, response, target, self.timeout_s)[0]
                   for name, fn in self.fns.items())


# ---- batch scoring: the trainer's entry point ----------------------------------------------------
def _worker(conn, reward_fns):
    _load_math_verify()
    conn.send("ready")
    while (job := conn.recv()) is not None:
        j, name, prompt, response, target, timeout_s = job
        conn.send((j, *safe_call(reward_fns[name], prompt, response, target, timeout_s)))


class RewardPool:
    """`workers` spawned processes holding `reward_fns`; `map` kills and replaces a worker whose call
    is still running `kill_grace_s` after its time limit (a C-level hang the signal cannot stop)."""

    def __init__(self, reward_fns, workers=2, kill_grace_s=1.0, start_timeout_s=120.0):
        self.reward_fns, self.kill_grace_s, self.start_timeout_s = reward_fns, kill_grace_s, start_timeout_s
        self.ctx = mp.get_context("spawn")  # fork would copy the trainer's threads/CUDA state
        self.workers = [self._start() for _ in range(workers)]
        self.num_restarts = 0

    def _start(self):
        conn, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child, self.reward_fns), daemon=True)
        proc.start()
        child.close()
        if not conn.poll(self.start_timeout_s) or conn.recv() != "ready":
            proc.kill()
            raise RuntimeError("reward worker failed to start")
        return {"proc": proc, "conn": conn, "job": None, "t0": 0.0, "limit": 0.0}

    def _restart(self, w):
        w["proc"].kill()
        w["proc"].join()
        w.update(self._start())
        self.num_restarts += 1

    def map(self, jobs, timeout_s=1.0):
        """jobs: [(name, prompt, response, target)] -> [(score, status)] in order."""
        out, todo = [None] * len(jobs), list(range(len(jobs)))[::-1]
        while todo or any(w["job"] is not None for w in self.workers):
            for w in self.workers:
                if w["job"] is None and todo:
                    j = todo.pop()
                    try:
                        w["conn"].send((j, *jobs[j], timeout_s))
                    except (OSError, ValueError):  # worker died between jobs: replace, retry later
                        todo.append(j)
                        self._restart(w)
                        continue
                    w["job"], w["t0"] = j, time.monotonic()
            busy = [w for w in self.workers if w["job"] is not None]
            ready = wait([w["conn"] for w in busy], timeout=0.05)
            for w in busy:
                if w["conn"] in ready:
                    try:
                        j, score, status = w["conn"].recv()
                        out[j], w["job"] = (score, status), None
                        continue
                    except (EOFError, OSError):  # the worker crashed mid-call (segfault, os._exit)
                        out[w["job"]], w["job"] = (0.0, "error"), None
                        self._restart(w)
                elif time.monotonic() - w["t0"] > timeout_s + self.kill_grace_s:
                    out[w["job"]], w["job"] = (0.0, "timeout"), None
                    self._restart(w)
        return out

    def close(self):
        for w in self.workers:
            try:
                w["conn"].send(None)
            except (OSError, ValueError):
                pass
            w["proc"].join(timeout=1.0)
            if w["proc"].is_alive():
                w["proc"].kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def score_batch(reward_fns, weights, prompts, responses, targets, timeout_s=1.0, pool=None):
    """Weighted total reward per sample, and stats: per reward its mean and failure counts.
    reward_fns: {name: callable}; weights: {name: float} (missing -> 1.0); pool: a RewardPool over the
    same reward_fns, or None to run in this process. -> (scores list[float], stats dict)"""
    names, n = list(reward_fns), len(responses)
    jobs = [(name, p, r, t) for name in names for p, r, t in zip(prompts, responses, targets)]
    if pool is not None:
        results = pool.map(jobs, timeout_s)
    else:
        results = [safe_call(reward_fns[name], p, r, t, timeout_s) for name, p, r, t in jobs]
    scores, stats = [0.0] * n, {}
    for k, name in enumerate(names):
        part, w = results[k * n : (k + 1) * n], (weights or {}).get(name, 1.0)
        for i, (value, _) in enumerate(part):
            scores[i] += w * value
        stats[f"rewards/{name}_mean"] = sum(v for v, _ in part) / max(n, 1)
        for status, key in (("error", "errors"), ("timeout", "timeouts"), ("nonfinite", "nonfinite")):
            stats[f"rewards/{name}_{key}"] = sum(st == status for _, st in part)
    return scores, stats
