"""Tests for rewards.py: extraction tables (right and wrong), GSM8K's own solutions as an oracle,
adversarial inputs under a time bound. The guard (safe_call, score_batch, RewardPool): test_reward_guard.py."""
import json
import re
import threading
import time

import pytest

from conftest import GSM8K_DIR
from rewards import (FormatReward, MathReward, ThinkingReward, WeightedReward, extract_answer, last_boxed,
                     to_number)

# (response, target, expected score) for MathReward() with default options
MATH_CASES = [
    # \boxed, nested braces, last box wins
    (r"so the total is \boxed{18}.", "18", 1.0),
    (r"so the total is \boxed{17}.", "18", 0.0),
    (r"first \boxed{3}, on reflection \boxed{4}", "4", 1.0),
    (r"first \boxed{4}, on reflection \boxed{3}", "4", 0.0),
    (r"\boxed{\boxed{7}}", "7", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{\tfrac34}", "0.75", 1.0),
    (r"\boxed{\frac{3}{5}}", "3/4", 0.0),
    (r"\boxed{{3}/{4}}", "0.75", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{-1}{2}}", "-1/2", 1.0),
    (r"\boxed{\fbox{5}}", "5", 1.0),
    (r"\boxed 5", "5", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{18 \text{ dollars}}", "18", 1.0),
    (r"\boxed{\$18.00}", "18", 1.0),
    (r"\boxed{5\text{ cm}^2}", "5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{1.5e3}", "1500", 1.0),
    (r"\boxed{1.5 \times 10^{3}}", "1500", 1.0),
    (r"\boxed{2.5E-2}", "0.025", 1.0),
    (r"\boxed{1.5e3}", "150", 0.0),
    (r"\boxed{−7}", "-7", 1.0),  # unicode minus
    (r"\boxed{7}", "-7", 0.0),
    (r"\boxed{3 + 4}", "7", 1.0),  # not a plain number: symbolic
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    (r"\boxed{\sqrt{2}}", "2^{1/2}", 1.0),
    (r"\boxed{\sqrt{3}}", "2^{1/2}", 0.0),
    (r"\boxed{}", "0", 0.0),
    (r"unclosed \boxed{12", "12", 1.0),  # no closed box: falls through to the last number
    # GSM8K "#### N"
    ("She makes 9 * 2 = $18.\n#### 18", "18", 1.0),
    ("She makes 9 * 2 = $18.\n#### 19", "18", 0.0),
    ("#### 1,450,000", "1450000", 1.0),
    ("#### 1,450,000", "1,450,000", 1.0),
    ("#### -10", "-10", 1.0),
    ("#### 10", "-10", 0.0),
    ("#### $70,000", "70000", 1.0),
    # "the answer is N"
    ("Adding up, the answer is 42.", "42", 1.0),
    ("The answer is: $1,234.50 in total", "1234.5", 1.0),
    ("The final answer is 50%.", "50", 1.0),
    ("so the answer is 3/4 of a cup", "0.75", 1.0),
    (r"so the answer is $\frac{3}{4}$", "0.75", 1.0),
    ("The answer is 41. I also counted 42 apples", "42", 0.0),  # "answer is" beats the last number
    # last number fallback: units, periods, decimals
    ("She has 7 apples.", "7", 1.0),
    ("It costs 12.50 dollars.", "12.5", 1.0),
    ("It costs 12.5 dollars.", "12.05", 0.0),
    ("no number here", "7", 0.0),
    ("", "7", 0.0),
]


@pytest.mark.parametrize("response,target,expected", MATH_CASES)
def test_math_reward_table(response, target, expected):
    assert MathReward()("prompt", response, target) == expected


def test_extraction_order_and_helpers():
    assert extract_answer(r"#### 3 and \boxed{4}") == ("4", "boxed")
    assert extract_answer("the answer is 5\n#### 6") == ("6", "hash")
    assert extract_answer("the answer is 5, not 6") == ("5, not 6", "answer_is")
    assert extract_answer("1 then 2 then 3") == ("3", "last_number")
    assert extract_answer("1 then 2 then 3", last_number=False) == (None, None)
    assert last_boxed(r"\boxed{a{b}{c{d}}e}") == "a{b}{c{d}}e"
    assert last_boxed(r"\boxed{a{b}") is None
    assert to_number("1,234") == 1234 and to_number("1,2") is None and to_number("3+4") is None
    assert to_number(r"\frac{1}{3}") * 3 == 1 and to_number("1/0") is None


def test_math_reward_options():
    hash_only = "9 * 2 = 18\n#### 18"
    assert MathReward(require_boxed=True)("", hash_only, "18") == 0.0
    assert MathReward(require_boxed=True)("", r"\boxed{18}", "18") == 1.0
    assert MathReward(require_boxed=True, partial_credit=0.1)("", hash_only, "18") == 0.1
    # partial credit: wrong final answer, but the target number appears in the work
    assert MathReward(partial_credit=0.1)("", "9 * 2 = 18, so \\boxed{19}", "18") == 0.1
    assert MathReward(partial_credit=0.1)("", "9 * 2 = 17, so \\boxed{19}", "18") == 0.0
    assert MathReward(last_number=False)("", "She has 7 apples.", "7") == 0.0
    assert MathReward(symbolic=False)("", r"\boxed{\sqrt{2}}", "2^{1/2}") == 0.0
    assert MathReward(rel_tol=1e-2)("", r"\boxed{0.333}", "1/3") == 1.0
    assert MathReward()("", r"\boxed{0.333}", "1/3") == 0.0


def test_math_reward_never_raises_on_odd_inputs():
    odd = ["\\boxed{", "}}}}", "\\frac{", "####", "answer is", "1/0", "\\boxed{1/0}", "0/0", "\x00\udcff",
           "\\boxed{\\frac{1}{0}}", "1e9999", "--5", "\\boxed{(}", "$" * 100, "\\text{" * 50]
    m = MathReward(partial_credit=0.5)
    for s in odd:
        for t in odd + ["5"]:
            assert 0.0 <= m("", s, t) <= 1.0


def _gsm8k_rows():
    with open(GSM8K_DIR / "test.jsonl") as f:
        return [json.loads(line) for line in f]


def test_gsm8k_reference_solutions_score_one_and_changed_answers_zero():
    rows, m = _gsm8k_rows(), MathReward()
    assert len(rows) == 1319
    t0 = time.monotonic()
    for row in rows:
        solution = row["answer"]
        target = solution.rsplit("####", 1)[1].strip().replace(",", "")
        assert m(row["question"], solution, target) == 1.0, solution
        head, last = re.match(r"(.*####\s*)(.*)$", solution, re.DOTALL).groups()
        wrong = str(int(target) + 1) if target.lstrip("-").isdigit() else target + "1"
        assert m(row["question"], head + wrong, target) == 0.0, head + wrong
    assert time.monotonic() - t0 < 20  # ~2k calls: the extractors are cheap


ADVERSARIAL = [
    (r"\boxed{10^{10^{10^{10}}}}", "10"),
    (r"the answer is 10^{10^{10^{10}}}", "10^{10^{10^{10}}}"),
    (r"\boxed{10^{10^{10^{10}}}}", r"10^{10^{10^{10}}}"),
    (r"\boxed{2^{99999999}}", "2"),
    (r"\boxed{99999!}", "3"),
    ("\\boxed{" + "{" * 500_000 + "}" * 500_000 + "}", "1"),
    ("{" * 1_000_000 + r"\boxed{42}", "42"),
    ("\\boxed{" * 150_000, "1"),
    ("1" * 100_000, "1" * 100_000),
    ("\\boxed{" + "9" * 100_000 + "}", "9" * 100_000),
    ("#### " + "9" * 100_000, "9"),
    ("1e" + "9" * 100_000, "1"),
    ("the answer is " + " " * 1_000_000 + "5", "5"),
    ("1," * 500_000, "1"),
    ("1.5 \\times 10^{" * 50_000, "1"),
    # short enough for sympy, slow inside it: stopped by the symbolic time limit (0.5 s)
    (r"\boxed{(x+1)^{999}}", "5"),
    (r"\boxed{((10^{999})^{999})^{999}}", "5"),
    (r"\boxed{\sum_{k=1}^{999} k^{999}}", r"\sum_{k=1}^{999} k^{998}"),
]


@pytest.mark.parametrize("response,target", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_are_fast(response, target):
    m = MathReward(partial_credit=0.1)
    t0 = time.monotonic()
    score = m("", response, target)
    assert time.monotonic() - t0 < 1.0
    assert score in (0.0, 0.1, 1.0)
    if response.endswith(r"\boxed{42}"):
        assert score == 1.0
    t0 = time.monotonic()
    ThinkingReward()(response, response, target)
    FormatReward(r"^<think>.*?</think>\s*\\boxed\{.*\}$")("", response, target)
    assert time.monotonic() - t0 < 1.0


def test_symbolic_is_skipped_off_the_main_thread():
    # no SIGALRM timer in a thread, so sympy is not run at all there (use RewardPool for threads)
    out = []
    th = threading.Thread(target=lambda: out.extend(
        [MathReward()("", r"\boxed{(x+1)^{999}}", "5"), MathReward()("", r"\boxed{\sqrt{2}}", "2^{1/2}"),
         MathReward()("", r"\boxed{\frac{3}{4}}", "0.75")]))
    t0 = time.monotonic()
    th.start()
    th.join()
    assert out == [0.0, 0.0, 1.0] and time.monotonic() - t0 < 1.0


def test_thinking_reward():
    r = ThinkingReward(partial_credit=0.2)
    assert r("", "<think>add 2 and 2</think> 4", "") == 1.0
    assert r("", "<think>  \n </think> 4", "") == 0.2  # empty block
    assert r("", "<think>add 2 and 2 ... 4", "") == 0.2  # unclosed
    assert r("", "add 2 and 2</think> 4", "") == 0.2  # closed, never opened
    assert r("<|im_start|>assistant\n<think>\n", "add 2 and 2</think> 4", "") == 1.0  # template opened it
    assert r("", "< Think >x</think >", "") == 0.2
    assert r("", "4", "") == 0.0
    assert r("", "<think>" * 200_000, "") == 0.2
    assert ThinkingReward(tag="reasoning")("", "<reasoning>x</reasoning>", "") == 1.0
    assert ThinkingReward(tag="reasoning")("", "<think>x</think>", "") == 0.0


def test_format_reward_and_weighted():
    fmt = FormatReward(r"^<think>.+?</think>\s*<answer>.+?</answer>$")
    assert fmt("", "<think>a\nb</think> <answer>4</answer>", "") == 1.0
    assert fmt("", "<think>a</think> <answer>4</answer> extra", "") == 0.0
    assert FormatReward("x", max_chars=10)("", "x" * 11, "") == 0.0
    combo = WeightedReward({"math": MathReward(), "think": ThinkingReward(), "bad": raises},
                           {"math": 1.0, "think": 0.5})
    assert combo("", r"<think>2+2</think> \boxed{4}", "4") == 1.5
    assert combo("", r"\boxed{5}", "4") == 0.0


def raises(prompt, response, target):
    raise ValueError("bad reward")
