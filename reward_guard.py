"""The reward guard: a reward function can neither crash nor stall the run.

rewards.py's callables are written to be safe, but a researcher's own reward may raise, loop, return
None or NaN, or hang inside a C extension. Every call from the trainer goes through this file:

- `safe_call(fn, prompt, response, target, timeout_s)` -> (score, status), status one of ok | error
  | timeout | nonfinite. An exception, a None/NaN/inf result or a call past `timeout_s` scores 0.0.
- `time_limit(seconds)`: raises RewardTimeout inside the block after `seconds`, via SIGALRM armed
  with setitimer. CPython checks for the signal between bytecodes and inside `re` and big-int loops,
  so pure Python cannot outrun it. It nests (the earliest deadline fires first; `enclosing_expired`
  tells a reward's own limit from its caller's) and restores whoever else uses SIGALRM
  (pytest-timeout). Signals reach only the main thread: off it there is no timer, and a late call is
  detected afterwards.
- `score_batch(reward_fns, weights, ...)`: the trainer's entry point. Weighted total per sample; per
  reward its mean and failure counts (`rewards/<name>_errors|_timeouts|_nonfinite`), which the
  trainer logs every step, so a reward that quietly fails is visible on the first curve.
- `RewardPool`: a C extension that never checks signals can still hang a process. The pool runs
  rewards in spawned worker processes, kills a worker still busy `kill_grace_s` after its limit and
  starts a fresh one (`rollout.reward_workers > 0`).

Left out: memory limits for a reward (a worker that allocates without bound takes the machine with
it), sandboxing of untrusted code.
"""
import math
import multiprocessing as mp
import signal
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import wait


class RewardTimeout(BaseException):  # BaseException: a reward's own `except Exception` can't eat it
    def __init__(self, deadline):
        super().__init__(deadline)
        self.deadline = deadline


_deadlines = []  # absolute time.monotonic() deadlines of the active, nested time_limit blocks


def _on_alarm(signum, frame):
    raise RewardTimeout(min(_deadlines, default=0.0))


def _arm():
    signal.setitimer(signal.ITIMER_REAL, max(min(_deadlines) - time.monotonic(), 1e-4))


@contextmanager
def time_limit(seconds):
    """Raise RewardTimeout(deadline) in the block after `seconds`; nests; yields the deadline, or
    inf (no limit) off the main thread, where signals cannot be delivered."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield math.inf
        return
    if not _deadlines:  # outermost: restore whoever else uses SIGALRM (pytest-timeout) afterwards
        saved, t0 = (signal.signal(signal.SIGALRM, _on_alarm),
                     signal.getitimer(signal.ITIMER_REAL)[0]), time.monotonic()
    deadline = time.monotonic() + seconds
    _deadlines.append(deadline)
    try:
        _arm()
        yield deadline
    finally:
        try:  # the alarm can fire just before this line; the inner finally still restores state
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            _deadlines.remove(deadline)
            if _deadlines:
                _arm()
            else:
                signal.signal(signal.SIGALRM, saved[0])
                if saved[1]:
                    signal.setitimer(signal.ITIMER_REAL,
                                     max(saved[1] - (time.monotonic() - t0), 1e-4))


def enclosing_expired(e: RewardTimeout) -> bool:
    """Outside a time_limit block that caught `e`: did a limit that is still active (an enclosing
    one) expire?"""
    return e.deadline in _deadlines


def safe_call(fn, prompt, response, target, timeout_s=1.0):
    """-> (score, status), status in ok | error | timeout | nonfinite. Never raises; 0.0 on
    failure."""
    t0 = time.monotonic()
    try:
        with time_limit(timeout_s):
            value = fn(prompt, response, target)
    except RewardTimeout:
        return 0.0, "timeout"
    except Exception:
        return 0.0, "error"
    # off the main thread: caught only afterwards
    if timeout_s and time.monotonic() - t0 > timeout_s:
        return 0.0, "timeout"
    if value is None:
        return 0.0, "nonfinite"
    try:
        value = float(value)
    except Exception:
        return 0.0, "error"
    return (value, "ok") if math.isfinite(value) else (0.0, "nonfinite")


def _worker(conn, reward_fns):  # unpickling reward_fns ran their warm-up (MathReward imports sympy)
    # spawn re-imported the trainer's module: one thread, run while the trainer waits
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        j, name, prompt, response, target, timeout_s = job
        conn.send((j, *safe_call(reward_fns[name], prompt, response, target, timeout_s)))


class RewardPool:
    """`workers` spawned processes holding `reward_fns` (spawn, not fork: the trainer has threads
    and maybe CUDA). `map` kills and replaces a worker still busy `kill_grace_s` after its time
    limit."""

    def __init__(self, reward_fns, workers=2, kill_grace_s=1.0, start_timeout_s=120.0):
        self.reward_fns, self.kill_grace_s, self.start_timeout_s = (
            reward_fns, kill_grace_s, start_timeout_s)
        self.ctx, self.num_restarts = mp.get_context("spawn"), 0
        self.workers = [self._start() for _ in range(workers)]

    def _start(self, old=None):
        if old is not None:
            old["proc"].kill()
            old["proc"].join()
            self.num_restarts += 1
        conn, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child, self.reward_fns), daemon=True)
        proc.start()
        child.close()
        if not conn.poll(self.start_timeout_s) or conn.recv() != "ready":
            proc.kill()
            raise RuntimeError("reward worker failed to start")
        return {"proc": proc, "conn": conn, "job": None, "t0": 0.0}

    def map(self, jobs, timeout_s=1.0):
        """jobs: [(name, prompt, response, target)] -> [(score, status)], in order."""
        out, todo = [None] * len(jobs), list(range(len(jobs)))[::-1]
        while todo or any(w["job"] is not None for w in self.workers):
            for k, w in enumerate(self.workers):
                if w["job"] is None and todo:
                    try:
                        w["conn"].send((todo[-1], *jobs[todo[-1]], timeout_s))
                        w["job"], w["t0"] = todo.pop(), time.monotonic()
                    except (OSError, ValueError):  # died between jobs: replace it, the job waits
                        self.workers[k] = w = self._start(w)
            busy = [w for w in self.workers if w["job"] is not None]
            ready = wait([w["conn"] for w in busy], timeout=0.05)
            for k, w in enumerate(self.workers):
                if w["job"] is None:
                    continue
                if w["conn"] in ready:
                    try:
                        j, score, status = w["conn"].recv()
                        out[j], w["job"] = (score, status), None
                        continue
                    except (EOFError, OSError):  # crashed mid-call (segfault, os._exit)
                        out[w["job"]] = (0.0, "error")
                elif time.monotonic() - w["t0"] > timeout_s + self.kill_grace_s:  # hung in C
                    out[w["job"]] = (0.0, "timeout")
                else:
                    continue
                self.workers[k] = self._start(w)
        return out

    def close(self):
        for w in self.workers:
            try:
                w["conn"].send(None)
            except (OSError, ValueError):
                pass
            w["proc"].join(timeout=1.0)
            w["proc"].kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def score_batch(reward_fns, weights, prompts, responses, targets, timeout_s=1.0, pool=None,
                per_reward=False):
    """Weighted total per sample, plus per reward its mean and failure counts.
    reward_fns {name: callable}; weights {name: float} (missing -> 1.0); pool: a RewardPool over the
    same reward_fns, or None to run here. -> (scores list[float], stats dict), and with `per_reward`
    a third: {name: each sample's unweighted score} (the trainer's accuracy is
    rollout.accuracy's)."""
    names, n = list(reward_fns), len(responses)
    jobs = [(k, p, r, t) for k in names for p, r, t in zip(prompts, responses, targets)]
    if pool is not None:
        results = pool.map(jobs, timeout_s)
    else:
        results = [safe_call(reward_fns[k], p, r, t, timeout_s) for k, p, r, t in jobs]
    scores, stats, parts = [0.0] * n, {}, {}
    for i, name in enumerate(names):
        part = results[i * n : (i + 1) * n]
        parts[name] = [v for v, _ in part]
        for s, (value, _) in enumerate(part):
            scores[s] += (weights or {}).get(name, 1.0) * value
        stats[f"rewards/{name}_mean"] = sum(v for v, _ in part) / max(n, 1)
        for status, key in (("error", "errors"), ("timeout", "timeouts"),
                            ("nonfinite", "nonfinite")):
            stats[f"rewards/{name}_{key}"] = sum(st == status for _, st in part)
    return (scores, stats, parts) if per_reward else (scores, stats)
