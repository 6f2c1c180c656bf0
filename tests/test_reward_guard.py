"""Tests for reward_guard.py: every way a reward can misbehave (raise, NaN, None, spin, catastrophic regex,
a C-level hang) scores 0 and is counted; time limits nest; the killable worker pool agrees with in-process."""
import math
import signal
import threading
import time

import pytest

from reward_guard import RewardPool, RewardTimeout, safe_call, score_batch, time_limit
from rewards import FormatReward, MathReward, ThinkingReward


# Rewards that misbehave. Module-level so a spawned RewardPool worker can unpickle them.
def raises(prompt, response, target):
    raise ValueError("bad reward")


def returns_nan(prompt, response, target):
    return math.nan


def returns_inf(prompt, response, target):
    return -math.inf


def returns_none(prompt, response, target):
    return None


def returns_text(prompt, response, target):
    return "one"


def spins(prompt, response, target):  # a Python-level hang: the signal interrupts it
    while True:
        pass


def hangs_in_c(prompt, response, target):  # like a C extension that never checks for signals
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(60)


def test_safe_call_statuses():
    assert safe_call(MathReward(), "", r"\boxed{4}", "4") == (1.0, "ok")
    assert safe_call(raises, "", "", "") == (0.0, "error")
    assert safe_call(returns_nan, "", "", "") == (0.0, "nonfinite")
    assert safe_call(returns_inf, "", "", "") == (0.0, "nonfinite")
    assert safe_call(returns_none, "", "", "") == (0.0, "nonfinite")
    assert safe_call(returns_text, "", "", "") == (0.0, "error")
    t0 = time.monotonic()
    assert safe_call(spins, "", "", "", timeout_s=0.2) == (0.0, "timeout")
    # CPython's regex engine checks for signals, so catastrophic backtracking is stopped too
    assert safe_call(FormatReward(r"(a+)+$"), "", "a" * 40 + "b", "", timeout_s=0.2) == (0.0, "timeout")
    assert time.monotonic() - t0 < 1.0


def test_time_limit_nesting():
    # the inner limit expiring is swallowed by its owner; the outer one still fires on time
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout):
        with time_limit(0.3) as outer:
            with pytest.raises(RewardTimeout):
                with time_limit(0.05):
                    spins("", "", "")
            spins("", "", "")
    assert 0.25 < time.monotonic() - t0 < 1.0
    # an inner limit longer than the outer one: the outer deadline wins and propagates
    with pytest.raises(RewardTimeout) as e:
        with time_limit(0.1) as outer:
            with time_limit(5.0):
                spins("", "", "")
    assert e.value.deadline == outer


def test_score_batch_counts_failures_and_continues():
    fns = {"math": MathReward(), "think": ThinkingReward(), "raises": raises, "nan": returns_nan,
           "none": returns_none, "spins": spins}
    responses = [r"<think>2+2</think> \boxed{4}", r"\boxed{5}", "<think>x"]
    scores, stats = score_batch(fns, {"math": 1.0, "think": 0.5}, ["p"] * 3, responses, ["4"] * 3,
                                timeout_s=0.1)
    assert scores == [1.5, 0.0, 0.1]
    assert stats["rewards/math_mean"] == pytest.approx(1 / 3)
    assert stats["rewards/raises_errors"] == 3 and stats["rewards/raises_timeouts"] == 0
    assert stats["rewards/nan_nonfinite"] == 3 and stats["rewards/none_nonfinite"] == 3
    assert stats["rewards/spins_timeouts"] == 3 and stats["rewards/math_errors"] == 0


def test_score_batch_off_main_thread_measures_time():
    def slow(prompt, response, target):
        time.sleep(0.2)
        return 1.0
    out = {}
    th = threading.Thread(target=lambda: out.update(r=score_batch({"slow": slow}, None, [""], [""], [""],
                                                                  timeout_s=0.05)))
    th.start()
    th.join()
    assert out["r"] == ([0.0], {"rewards/slow_mean": 0.0, "rewards/slow_errors": 0,
                                "rewards/slow_timeouts": 1, "rewards/slow_nonfinite": 0})


def test_reward_pool_survives_c_level_hang():
    fns = {"math": MathReward(), "regex": FormatReward(r"^a+$"), "raises": raises, "spins": spins,
           "hang": hangs_in_c}
    responses = [r"\boxed{4}", "a" * 40 + "b", "aaa", r"\boxed{5}"]
    with RewardPool(fns, workers=2, kill_grace_s=1.0) as pool:
        t0 = time.monotonic()
        scores, stats = score_batch(fns, None, [""] * 4, responses, ["4"] * 4, timeout_s=0.2, pool=pool)
        assert time.monotonic() - t0 < 30
        assert pool.num_restarts >= 4 and stats["rewards/hang_timeouts"] == 4  # killed and replaced
        assert stats["rewards/raises_errors"] == 4
        assert stats["rewards/spins_timeouts"] == 4  # soft timeouts: caught in the worker, no restart
        assert scores == [1.0, 0.0, 1.0, 0.0]
        # the same batch in-process (minus the hang) agrees with the pool
        safe = {"math": fns["math"], "raises": raises}
        assert score_batch(safe, None, [""] * 4, responses, ["4"] * 4, pool=pool) == \
            score_batch(safe, None, [""] * 4, responses, ["4"] * 4)
