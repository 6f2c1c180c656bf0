"""Multi-turn environments: the file a researcher edits to train on tools, feedback and games.

Contract (text in, text out; an env never sees a token id):

    env = MyEnv(problem, seed, **kwargs)   # problem: "question" (+ data.instruction), "target"; one
                                             per episode
    env.reset() -> list[message]           # the opening conversation: a pure function of (problem,
                                             seed)
    env.step(assistant_text) -> Step(messages, done, reward=None, info={})

A message is {"role": "user" | "tool" | "system", "content": str}; the env's replies are never
"assistant" (the opening conversation may hold worked examples as assistant turns: they are prompt,
never trained on). `step` receives the text of each sampled reply (special tokens stripped) and
answers with the next messages, or done. An episode's scalar is `Step.reward` when the env gives
one, plus `rollout.rewards` on the last reply (`math` scores it against `problem["target"]`, or
against `env.target` where an env sets one: guess's secret).

Chosen in the config: `rollout.env = "calculator"`, `{"name": "retry", "attempts": 2}`, or
"my_env.py:MyEnv" (any class with this contract). The G samples of a problem get envs built from the
same (problem, seed), so they face the same secret. Token ids, the trainable mask, logprobs and
every limit (turns, episode length, reply size, time per step, an env that raises) are the rollout's
business (episodes.py), not the env's.

Built-ins, each a few lines of what it teaches:
- `Calculator`: a tool call. The system prompt shows `<calc>23*47</calc>` once and the opening
  conversation holds one worked episode (CALC_EXAMPLE); the env answers `<result>1081</result>`,
  computed by `arith`, a whitelisted `ast` evaluator (never eval). A reply without a call is the
  final answer.
- `Retry`: learning from feedback. A wrong answer gets "Wrong, try again." up to `attempts` tries; a
  right one earns `discount ** (attempt - 1)`.
- `Guess`: a game with state. Guess the number in [low, high] from higher/lower hints; a win on
  guess g earns 1 - cost * (g - 1). Random guessing already wins some, so there is signal from the
  first step.
- `Python`: code as a tool. `<python>print(23*47)</python>` runs in the sandbox (sandbox.py: its own
  process, user, network and filesystem view, killed at its limit) and `<output>1081</output>` comes
  back, truncated.
Left out: tool schemas in the chat template (SmolLM2's ignores `tools`; the prompt teaches the
call), several tools per env, async envs.
"""
import ast
import operator
import random
import re
from dataclasses import dataclass, field

import seeds


@dataclass
class Step:
    messages: list          # the env's reply: [{"role": "user", "content": ...}], empty when done
    done: bool
    reward: float | None = None  # the episode's env reward, read when done (None: only
    #                              rollout.rewards score it)
    info: dict = field(default_factory=dict)  # {"tool_call": True} is counted in episode/tool_calls


# ---- a calculator that only does arithmetic ------------------------------------------------------
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
       ast.Pow: operator.pow}
MAX_ABS = 10 ** 15  # every intermediate value; 9**9**9 is refused before it is computed


def arith(expr: str, max_chars: int = 100):
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses. Anything else
    (names, attributes, calls, strings, huge powers or values) raises ValueError with a message the
    model can read."""
    expr = expr.replace("×", "*").replace("÷", "/").replace("^", "**").replace(",", "").strip()
    if not expr or len(expr) > max_chars:
        raise ValueError(f"expression must be 1 to {max_chars} characters")
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            v = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10 ** 6):
                raise ValueError("power too large")
            try:
                v = OPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            except OverflowError:
                raise ValueError("value out of range") from None
        else:
            raise ValueError(f"only numbers and + - * / ( ) are allowed, not {type(node).__name__}")
        if isinstance(v, complex) or abs(v) > MAX_ABS:
            raise ValueError("value out of range")
        return v

    v = ev(tree)
    return int(v) if float(v).is_integer() else round(v, 6)


CALC_PROMPT = ("You can use a calculator. Write <calc>expression</calc> and you get "
               "<result>value</result>, for example <calc>23*47</calc> gives "
               "<result>1081</result>. When you know the answer, reply with the number only.")


# One worked episode in the opening conversation: told about the tool in the system prompt alone,
# SmolLM2-135M made no call in 256 samples of 2-digit problems; shown this once, 77% of its greedy
# replies call it (23% at T=1).
CALC_EXAMPLE = [{"role": "user",
                 "content": "Mia has 38 shells. She finds 45 more. How many shells now?"},
                {"role": "assistant", "content": "<calc>38+45</calc>"},
                {"role": "user", "content": "<result>83</result>"},
                {"role": "assistant", "content": "83"}]


class Calculator:
    """One tool: <calc>expr</calc> -> <result>value</result> (or <error>why</error>); no call = the
    final answer. `example`: open with CALC_EXAMPLE, a worked episode (prompt, never trained on)."""

    def __init__(self, problem, seed=0, prompt=CALC_PROMPT, example=True):
        self.problem, self.prompt, self.example = problem, prompt, example

    def reset(self):
        return [{"role": "system", "content": self.prompt}, *(CALC_EXAMPLE if self.example else []),
                {"role": "user", "content": self.problem["question"]}]

    def step(self, text):
        call = re.search(r"<calc>(.*?)</calc>", text, re.DOTALL)
        if call is None:
            return Step([], done=True)
        try:
            reply = f"<result>{arith(call[1])}</result>"
        except ValueError as e:
            # refused input is an answer to the model, never an exception out of the env
            reply = f"<error>{e}</error>"
        return Step([{"role": "user", "content": reply}], done=False, info={"tool_call": True})


class Retry:
    """A wrong final answer gets "Wrong, try again." until `attempts` tries are spent; the right one
    on try k earns discount ** (k - 1), and the last wrong one 0."""

    def __init__(self, problem, seed=0, attempts=3, discount=0.5):
        import rewards  # the same answer check as the math reward
        self.problem, self.attempts, self.discount, self.tries = problem, attempts, discount, 0
        self.correct = rewards.MathReward(symbolic=False)

    def reset(self):
        return [{"role": "user", "content": self.problem["question"]}]

    def step(self, text):
        self.tries += 1
        if self.correct(self.problem["question"], text, str(self.problem["target"])) >= 1:
            return Step([], done=True, reward=self.discount ** (self.tries - 1))
        if self.tries == self.attempts:
            return Step([], done=True, reward=0.0)
        return Step([{"role": "user", "content": "Wrong, try again."}], done=False)


class Guess:
    """Guess the secret in [low, high] with higher/lower hints, at most `guesses` tries; the secret
    is drawn from (seed, question), so the G siblings of a problem share it."""

    def __init__(self, problem, seed=0, low=1, high=16, guesses=5, cost=0.15):
        self.low, self.high, self.guesses, self.cost, self.tries = low, high, guesses, cost, 0
        self.target = (random.Random(seeds.seed(seed, "guess", problem["question"]))
                       .randint(low, high))

    def reset(self):
        return [{"role": "system",
                 "content": "You are playing a guessing game. Reply with one number only."},
                {"role": "user",
                 "content": f"I am thinking of a number from {self.low} to {self.high}. Guess it."}]

    def step(self, text):
        self.tries += 1
        nums = re.findall(r"-?\d{1,6}", text)
        if nums and int(nums[-1]) == self.target:
            return Step([], done=True, reward=1.0 - self.cost * (self.tries - 1))
        if self.tries == self.guesses:
            return Step([], done=True, reward=0.0)
        hint = ("Higher." if int(nums[-1]) < self.target else "Lower.") if nums else \
            f"Reply with one number from {self.low} to {self.high}."
        return Step([{"role": "user", "content": hint}], done=False)


PY_PROMPT = ("You can run Python. Write <python>code</python> and you get "
             "<output>what it printed</output>. When you are done, reply without a <python> call.")


class Python:
    """A Python interpreter as a tool: the code between <python> tags runs in the sandbox
    (sandbox.py, never in this process) and its stdout and stderr come back cut to `max_chars`; a
    reply without a call is the final answer. `tag=""` runs every reply (raw-code policies; ends by
    max_turns). Keep rollout.env_timeout_s above `timeout_s` plus the sandbox's ~0.1 s start."""

    def __init__(self, problem, seed=0, timeout_s=1.0, memory_mb=256, max_chars=400, tag="python",
                 prompt=PY_PROMPT):
        self.problem, self.timeout_s, self.memory_mb, self.max_chars = (
            problem, timeout_s, memory_mb, max_chars)
        self.tag, self.prompt = tag, prompt

    def reset(self):
        return [{"role": "system", "content": self.prompt},
                {"role": "user", "content": self.problem["question"]}]

    def step(self, text):
        import sandbox
        call = (re.search(rf"<{self.tag}>(.*?)</{self.tag}>", text, re.DOTALL) if self.tag
                else [text, text])
        if call is None:
            return Step([], done=True)
        r = sandbox.run(call[1], timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                        max_output=4 * self.max_chars)
        out = (r.stdout + r.stderr[-self.max_chars // 2:])[-self.max_chars:]
        status = "" if r.status == "ok" else f" ({r.status})"
        return Step([{"role": "user", "content": f"<output>{out}</output>{status}"}], done=False,
                    info={"tool_call": True, "sandbox": r.status})


# names for rollout.env
BUILTIN = {"calculator": Calculator, "retry": Retry, "guess": Guess, "python": Python}
