"""Multi-turn episodes (envs.py, episodes.py) against oracles: the calculator's evaluator against Python on what it
accepts and a refusal on what it must not run; bridge-built ids against a full re-render of the same messages
(tiny, SmolLM2 and Qwen2 templates); each episode's ids and mask against the replies the generator actually
returned (recorded) and the env's messages; the trainer's logprobs on a whole episode against the generator's
(torch and vLLM; SmolLM2's is in test_real_model.py); envs that raise, hang or return garbage end only their own
episode; GRPO runs with each env, colocated and with a vLLM rank, and single-turn as the one-turn episode."""
import json
import math
import shutil
import time

import pytest
import torch

import checks
import data
import envs
import episodes
import generator
import packing
import train_grpo
from config import ConfigError
from model import Transformer
from test_train_grpo import metrics, run
from types import SimpleNamespace as NS


# ---- envs.py ---------------------------------------------------------------------------------------------------
def test_arith_evaluates_arithmetic_and_refuses_everything_else():
    for expr in ["23*47", "(12+3)*4-5", "100/8", "7//2", "7 % 3", "-3 + +4", "2**10", "1,081 + 1", "6×7", "8÷2",
                 "2^5", "0.5*4", "10**15"]:
        want = eval(expr.replace(",", "").replace("×", "*").replace("÷", "/").replace("^", "**"))  # the oracle
        assert envs.arith(expr) == (int(want) if float(want).is_integer() else round(want, 6)), expr
    for expr in ["__import__('os').system('ls')", "x + 1", "(1).real", "abs(-1)", "'a' * 3", "[1, 2]", "9**9**9",
                 "2**1000", "10**16", "1e300 * 1e300", "(10.0**6)**60", "1/0", "", "1" * 101, "lambda: 1",
                 "(-8) ** 0.5", "1 if 1 else 2", "1 < 2", "\x00"]:
        with pytest.raises(ValueError):
            envs.arith(expr)


def test_builtin_envs_follow_the_contract():
    p = {"question": "Ann has 23 pens. She buys 47 more. How many pens now?", "target": "70"}
    calc = envs.Calculator(p)
    opening = calc.reset()
    assert [m["role"] for m in opening] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "<calc>23*47</calc>" in opening[0]["content"] and opening[-1]["content"] == p["question"]
    assert [m["role"] for m in envs.Calculator(p, example=False).reset()] == ["system", "user"]
    s = calc.step("Let me add. <calc>23 + 47</calc>")
    assert s == envs.Step([{"role": "user", "content": "<result>70</result>"}], done=False, info={"tool_call": True})
    s = calc.step("<calc>__import__('os')</calc>")  # refused with a reply, not an exception
    assert not s.done and s.messages[0]["content"].startswith("<error>") and "Call" in s.messages[0]["content"]
    assert calc.step("The answer is 70.").done

    retry = envs.Retry(p, attempts=3, discount=0.5)
    assert retry.step("71") == envs.Step([{"role": "user", "content": "Wrong, try again."}], done=False)
    assert retry.step("The answer is 70.") == envs.Step([], done=True, reward=0.5)
    retry = envs.Retry(p, attempts=2)
    retry.step("1")
    assert retry.step("2") == envs.Step([], done=True, reward=0.0)

    secrets = {envs.Guess({"question": f"q{i}"}, seed=3).target for i in range(40)}
    assert secrets <= set(range(1, 17)) and len(secrets) > 8
    g, h = envs.Guess({"question": "q"}, seed=3), envs.Guess({"question": "q"}, seed=3)
    assert g.target == h.target  # the G siblings of a problem share the secret
    hints = [g.step(str(x)).messages for x in (0, 17)]
    assert hints == [[{"role": "user", "content": "Higher."}], [{"role": "user", "content": "Lower."}]]
    assert g.step("no idea").messages[0]["content"] == "Reply with one number from 1 to 16."
    assert g.step(str(g.target)) == envs.Step([], done=True, reward=1.0 - 0.15 * 3)
    g = envs.Guess({"question": "q"}, seed=3, guesses=1)
    assert g.step(str(g.target % 16 + 1)) == envs.Step([], done=True, reward=0.0)


def test_env_config_names_the_closest_env_and_drops_overlong_shaping(tiny_ckpt, capsys):
    base = ["configs/tiny.py", f"--model.path={tiny_ckpt}", "--rollout.overlong_cache=0"]
    cfg = train_grpo.parse_config([*base, "--rollout.env={'name': 'retry', 'attempts': 2}"])
    assert cfg.rollout.env == {"name": "retry", "attempts": 2}
    checks.grpo(cfg, 1)
    assert train_grpo.parse_config([*base, "--rollout.env=guess"]).rollout.env == "guess"
    with pytest.raises(ConfigError, match="unknown env 'calculater' \\(did you mean 'calculator'\\?\\)"):
        checks.grpo(train_grpo.parse_config([*base, "--rollout.env=calculater"]), 1)
    with pytest.raises(ConfigError, match="cannot load 'nope.py:Env'"):
        checks.grpo(train_grpo.parse_config([*base, "--rollout.env=nope.py:Env"]), 1)
    cfg = train_grpo.parse_config(["configs/tiny.py", f"--model.path={tiny_ckpt}",
                                   "--rollout.env=guess"])
    # tiny.py's: single-turn only, so dropped with a note, not refused
    assert cfg.rollout.overlong_cache == 16
    checks.grpo(cfg, 1)
    assert (cfg.rollout.overlong_cache == 0
            and "rollout.overlong_cache=16 dropped" in capsys.readouterr().err)
    cfg = train_grpo.parse_config([*base, "--rollout.env=guess", "--rollout.max_episode_tokens=8"])
    # a budget that cannot hold one reply is raised to max_turns replies, with a note
    checks.grpo(cfg, 1)
    assert cfg.rollout.max_episode_tokens == cfg.rollout.max_turns * cfg.rollout.max_tokens
    assert "rollout.max_episode_tokens=8 raised" in capsys.readouterr().err
    cfg = train_grpo.parse_config([*base, "--rollout.env=retry", "--data.instruction= Just the number."])
    assert episodes.make_env(cfg, {"question": "Q?", "target": "1"}).reset()[0]["content"] == "Q? Just the number."
    with pytest.raises(ConfigError, match=r"Guess\(problem, seed, \*\*\{'secret': 3\}\) failed"):
        episodes.make_env(train_grpo.parse_config([*base, "--rollout.env={'name': 'guess', 'secret': 3}"]),
                          {"question": "q"})


# ---- token bookkeeping -----------------------------------------------------------------------------------------
def transcript(tok, opening, turns):
    """ids built the way episodes.py builds them (sampled replies encoded once, here), and the full re-render up to
    its last end-of-turn token (the glue after the last reply is not part of the episode)."""
    ids, messages = tok.apply_chat_template(opening, add_generation_prompt=True, tokenize=True), list(opening)
    for i, (reply, env_msgs) in enumerate(turns):
        ids += tok.encode(reply) + [tok.eos_token_id]
        messages.append({"role": "assistant", "content": reply})
        if env_msgs:
            ids += episodes.bridge(tok, env_msgs)
            messages += env_msgs
    return ids, episodes.end_of_turn(tok, tok.apply_chat_template(messages, tokenize=True))


CALC_TURNS = [("I will use the calculator. <calc>23*47</calc>", [{"role": "user", "content": "<result>1081</result>"}]),
              ("So the total is 1081. <calc>1081-81</calc>", [{"role": "user", "content": "<result>1000</result>"}]),
              ("1000", [])]


def test_bridge_equals_a_full_rerender_on_the_tiny_template(tiny_ckpt):
    tok = data.Tokenizer(tiny_ckpt)
    ids, full = transcript(tok, [{"role": "user", "content": "Tom has 23 pens."}], CALC_TURNS)
    assert ids == full


def test_rerender_metric_flags_ids_that_are_not_the_canonical_tokenization(tiny_ckpt):
    tok = data.Tokenizer(tiny_ckpt)
    opening = [{"role": "user", "content": "Tom has 23 pens."}]
    p = {"prompt_ids": tok.apply_chat_template(opening, add_generation_prompt=True, tokenize=True)}
    mt = episodes.MultiTurn(None, tok, None)
    reply = "The answer is 70."
    for ids, differs in ((tok.encode(reply), False), ([t for ch in reply for t in tok.encode(ch)], True)):
        assert len(ids) < len(reply) or differs  # the second spelling is one token per character: the same text
        e = episodes.Episode(None, [*opening, {"role": "assistant", "content": reply}], ids=ids + [tok.eos_token_id],
                             end="done")
        assert mt.completion(p, e, 0).metadata["rerender"] is differs


# Qwen2's ChatML template (a default system prompt when none is given; tool results as a user turn), on SmolLM2's
# tokenizer, which has the same <|im_start|> / <|im_end|> specials
QWEN2_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
    "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_bridge_equals_a_full_rerender_on_smollm2_and_qwen2_templates(smollm2, tmp_path):
    qwen2 = tmp_path / "qwen2_template"
    qwen2.mkdir()
    for f in ("tokenizer.json", "generation_config.json"):
        shutil.copy(smollm2 / f, qwen2 / f)
    cfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    (qwen2 / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": QWEN2_TEMPLATE}))
    for path in (smollm2, qwen2):
        tok = data.Tokenizer(path)
        assert "\n" == tok.decode(episodes.bridge(tok, [{"role": "user", "content": "x"}])[:1])  # ChatML's glue
        for opening in ([{"role": "user", "content": "Tom has 23 pens."}],  # SmolLM2 and Qwen2 add a system prompt
                        [{"role": "system", "content": envs.CALC_PROMPT}, {"role": "user", "content": "Tom?"}]):
            ids, full = transcript(tok, opening, CALC_TURNS)
            assert ids == full, (path, tok.decode(ids, False), tok.decode(full, False))
        tool = [("<calc>2+2</calc>", [{"role": "tool", "content": "4"}]), ("4", [])]
        ids, full = transcript(tok, [{"role": "user", "content": "2+2?"}], tool)
        assert ids == full


class Echo:
    """Asks the problem's question, replies "Again t." for `turns` turns, then done with reward 1."""

    def __init__(self, problem, seed=0, turns=3):
        self.t, self.turns, self.question = 0, turns, problem["question"]

    def reset(self):
        return [{"role": "user", "content": self.question}]

    def step(self, text):
        self.t += 1
        return envs.Step([], True, reward=1.0) if self.t >= self.turns else \
            envs.Step([{"role": "user", "content": f"Again {self.t}."}], False)


class Faulty(Echo):
    """Misbehaves in the way its problem's question says."""

    def __init__(self, problem, seed=0):
        super().__init__(problem, seed, turns=3)
        self.how = problem["question"]

    def step(self, text):
        if self.how == "raise":
            raise RuntimeError("env bug")
        if self.how == "hang":
            time.sleep(60)
        if self.how == "garbage":
            return ("not", "a", "Step")
        if self.how == "assistant":
            return envs.Step([{"role": "assistant", "content": "I speak for the model"}], False)
        if self.how == "huge":
            return envs.Step([{"role": "user", "content": "x" * 100_000}], False)
        return super().step(text)


class Recorder:
    """The engine, with every generate call's prompts and completions kept (the oracle for the bookkeeping)."""

    def __init__(self, gen):
        self.gen, self.calls = gen, []

    @property
    def version(self):
        return self.gen.version

    def generate(self, prompts, **kw):
        out = self.gen.generate(prompts, **kw)
        self.calls.append((prompts, out))
        return out


def play(gen, path, env, questions, n=4, max_tokens=16, stop_every=2, temperature=1.0, **rollout):
    """Episodes on the tiny random model. It samples nearly uniformly, so every `stop_every`-th merge token is made a
    stop token too (tok.eos_token_ids, which episodes.py passes as stop_token_ids): replies end after a few tokens."""
    tok = data.Tokenizer(path)
    if stop_every:
        tok.eos_token_ids = sorted({*tok.eos_token_ids, *range(262, 384, stop_every)})
    limits = dict(env=env, max_turns=4, max_episode_tokens=120, max_env_chars=50, env_timeout_s=0.5)
    cfg = NS(train=NS(seed=0), data=NS(instruction=""), rollout=NS(**{**limits, **rollout}))
    problems = [{"question": q, "target": "5"} for q in questions]
    for p in problems:
        p["prompt_ids"] = episodes.opening_ids(tok, episodes.make_env(cfg, p))
    rec = Recorder(gen)
    groups = episodes.MultiTurn(rec, tok, cfg).episodes(problems, n=n, seed=7, max_tokens=max_tokens,
                                                        temperature=temperature, top_p=1.0, top_k=-1)
    return tok, cfg, problems, groups, rec


def rebuild(tok, p, c, rec, env_reply):
    """Episode c of problem p from the recorded generate calls: the reply sampled at each turn, verbatim, then the
    bridge of the env's reply. Turn t's reply is a recorded output whose prompt is the opening prompt + the ids so
    far (siblings with the same prompt are told apart by c's own ids). Returns ids, mask, generator logprobs."""
    first = [out for prompt, outs in zip(*rec.calls[0]) if prompt == p["prompt_ids"] for out in outs]
    ids, mask, logp, turn = [], [], [], 1
    options = first
    while options:
        r = next((o for o in options if c.token_ids[len(ids):len(ids) + len(o.token_ids)] == o.token_ids), options[0])
        ids, mask, logp = ids + r.token_ids, mask + [1] * len(r.token_ids), logp + r.logprobs
        if turn == len(rec.calls):
            break
        b = episodes.bridge(tok, env_reply(turn))
        options = [outs[0] for prompt, outs in zip(*rec.calls[turn]) if prompt == p["prompt_ids"] + ids + b]
        if options:
            ids, mask, logp = ids + b, mask + [0] * len(b), logp + [0.0] * len(b)
        turn += 1
    return ids, mask, logp


def trainer_logp(model, problems, groups, tok):
    batch = packing.make_batch(problems, groups, tok.pad_token_id)
    with torch.no_grad():
        logp = packing.response_logp(model, batch, slice(0, len(batch["ids"])), 1.0)
    return logp, batch


def check_episodes(gen, path, model, tol, monkeypatch):
    """Ids, mask and logprobs of Echo episodes against the recorded replies; trainer logprobs against the generator's
    on every trainable token. Returns the max |dlogp| and how many episodes went past turn 1."""
    monkeypatch.setitem(envs.BUILTIN, "echo", Echo)
    tok, cfg, problems, groups, rec = play(gen, path, "echo", ["a", "b", "c"])
    multi = 0
    for k, p in enumerate(problems):
        for j, c in enumerate(groups[k]):
            ids, mask, logp = rebuild(tok, p, c, rec, lambda t: [{"role": "user", "content": f"Again {t}."}])
            assert (c.token_ids, c.mask, c.logprobs) == (ids, mask, logp)
            assert len(c.token_ids) <= cfg.rollout.max_episode_tokens
            multi += c.metadata["turns"] > 1
            assert c.metadata["end"] in ("done", "length", "context", "turns")
            if c.metadata["end"] == "done":
                assert c.metadata["turns"] == 3 and c.metadata["env_reward"] == 1.0 and c.finish_reason == "stop"
    logp, batch = trainer_logp(model, problems, groups, tok)
    diff = float(((logp - batch["gen_logp"]).abs() * batch["mask"]).max())
    assert diff <= tol, diff
    assert batch["mask"].sum() == sum(sum(c.mask) for g in groups for c in g)  # make_batch keeps the episode mask
    return diff, multi


def test_episode_ids_mask_and_logprobs_torch_generator(tiny_ckpt, monkeypatch):
    gen = generator.make_generator("torch", tiny_ckpt, max_model_len=200, seed=0)
    diff, multi = check_episodes(gen, tiny_ckpt, Transformer.from_pretrained(tiny_ckpt), 1e-5, monkeypatch)
    assert multi >= 6  # most of the 12 episodes took the env's reply and sampled again


def test_env_that_raises_hangs_or_returns_garbage_ends_only_its_episode(tiny_ckpt, monkeypatch):
    gen = generator.make_generator("torch", tiny_ckpt, max_model_len=200, seed=0)
    monkeypatch.setitem(envs.BUILTIN, "faulty", Faulty)
    t0 = time.monotonic()
    tok, cfg, problems, groups, _ = play(gen, tiny_ckpt, "faulty", ["raise", "hang", "garbage", "assistant", "huge",
                                                                     "fine"], n=3, stop_every=1)
    assert time.monotonic() - t0 < 20  # three hung steps cost env_timeout_s each, not a minute
    ends = {p["question"]: [c.metadata for c in g] for p, g in zip(problems, groups)}
    for how, why in (("raise", "raised RuntimeError"), ("hang", "timeout"), ("garbage", "garbage"),
                     ("assistant", "garbage")):
        stopped = [m for m in ends[how] if m["end"] != "length"]
        assert stopped and all(m["end"] == "error" and m["env_error"] == why for m in stopped), (how, ends[how])
    assert any(m["end"] in ("done", "turns", "context") and m["turns"] > 1 for m in ends["fine"])
    for c in groups[4]:  # the 100k-character reply entered cut to max_env_chars
        if c.metadata["turns"] > 1:
            assert 0 < len(c.mask) - sum(c.mask) <= cfg.rollout.max_env_chars + 16
    row = episodes.stats(groups)
    assert row["episode/error_frac"] >= 4 / 18 and abs(sum(row[f"episode/{e}_frac"] for e in episodes.ENDS) - 1) < 1e-9


def test_episode_ends_by_turns_and_context(tiny_ckpt, monkeypatch):
    gen = generator.make_generator("torch", tiny_ckpt, max_model_len=200, seed=0)
    monkeypatch.setitem(envs.BUILTIN, "echo10", lambda p, seed: Echo(p, seed, turns=10))
    for limits, end in ((dict(max_turns=2), "turns"), (dict(max_episode_tokens=40), "context")):
        *_, groups, _ = play(gen, tiny_ckpt, "echo10", ["a", "b"], stop_every=1, **limits)
        meta = [c for g in groups for c in g]
        assert any(c.metadata["end"] == end for c in meta), [c.metadata for c in meta]
        assert all(c.metadata["end"] in (end, "length") and len(c.token_ids) <= 40 + 16 for c in meta)
        assert all(c.finish_reason == "length" for c in meta)  # counted in rollout/truncated_frac


@pytest.mark.slow
def test_episode_logprobs_vllm_generator(tiny_ckpt, vllm_engine, monkeypatch):
    diff, multi = check_episodes(vllm_engine, tiny_ckpt, Transformer.from_pretrained(tiny_ckpt), 1e-5, monkeypatch)
    assert multi >= 6


# ---- the GRPO loop with envs (subprocesses, as users launch it) -------------------------------------------------
COLOCATED = ["--dist.generator_ranks=0", "--rollout.backend=torch", "--rollout.overlong_cache=0", "--eval.every=0",
             "--eval.num_problems=16", "--rollout.max_tokens=16", "--rollout.max_episode_tokens=96",
             "--rollout.max_turns=3", "--rollout.prompts_per_step=8", "--rollout.group_size=4",
             # a random model earns varied rewards
             "--rollout.rewards={'tests/_envs.py:digit_share': 1.0}"]


TIMES = ("perf/", "sync/")  # wall-clock figures: the only keys two identical runs may disagree on


@pytest.fixture
def train(tmp_path):
    """A colocated run, as users launch it (plain python; not train_grpo.main in this process: the session's vLLM
    engines have initialised torch.distributed here)."""
    return lambda args: run(args, tmp_path, nproc=0)


def rows_of(path):
    return [r for r in metrics(path / "metrics.jsonl") if "perf/step_s" in r]


def check_episode_rows(rows):
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
        assert abs(sum(r[f"episode/{e}_frac"] for e in episodes.ENDS) - 1) < 1e-6 and r["episode/turns"] >= 1
        assert r["episode/sampled_tokens"] <= r["rollout/response_len"]  # the mask leaves env tokens out


@pytest.mark.slow
def test_grpo_with_each_builtin_env_colocated_exact_resume_and_single_turn_unchanged(tmp_path, tiny_ckpt, train):
    for env in sorted(envs.BUILTIN):  # two steps each; guess four, with a checkpoint at step 2 for the resume below
        steps = ["--train.steps=4", "--ckpt.every=2"] if env == "guess" else ["--train.steps=2"]
        train([f"--model.path={tiny_ckpt}", *COLOCATED, *steps, f"--rollout.env={env}", f"--log.run={env}"])
        check_episode_rows(rows_of(tmp_path / env))
    # episodes are a pure function of (seed, step): resumed from step 2, steps 3-4 are played and trained again exactly
    shutil.copytree(tmp_path / "guess" / "ckpt" / "step_2", tmp_path / "guess2" / "ckpt" / "step_2")
    train([f"--model.path={tiny_ckpt}", *COLOCATED, "--train.steps=4", "--rollout.env=guess", "--log.run=guess2",
           "--ckpt.resume=auto"])
    resumed = rows_of(tmp_path / "guess2")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(rows_of(tmp_path / "guess")[2:], resumed):
        assert {k: v for k, v in a.items() if not k.startswith(TIMES)} == \
            {k: v for k, v in b.items() if not k.startswith(TIMES)}
    # single-turn is the one-turn episode: an env that ends after the first reply logs exactly what no env logs
    common = [f"--model.path={tiny_ckpt}", *COLOCATED, "--train.steps=2"]
    train([*common, "--log.run=plain"])
    train([*common, "--rollout.env=tests/_envs.py:Single", "--log.run=single"])
    plain, single = metrics(tmp_path / "plain" / "metrics.jsonl"), metrics(tmp_path / "single" / "metrics.jsonl")
    assert len(plain) == len(single) == 3 and single[-1]["episode/done_frac"] + single[-1]["episode/length_frac"] == 1
    for a, b in zip(plain, single):
        same = {k: v for k, v in b.items() if not k.startswith((*TIMES, "episode/"))}
        assert {k: v for k, v in a.items() if not k.startswith(TIMES)} == same
    assert plain[-1]["loss/pg"] != 0 and plain[-1]["train/grad_norm"] > 0  # the comparison covers a real update


@pytest.mark.slow
def test_grpo_with_envs_on_a_dedicated_vllm_rank_with_refill_staleness_and_pass_k(tmp_path, tiny_ckpt):
    """1 trainer + 1 vLLM rank playing all three built-ins (tests/_envs.py:Mixed: the env runs on the generator
    rank) with DAPO refill, two batches ahead, and pass@k eval."""
    out = run([f"--model.path={tiny_ckpt}", *COLOCATED[2:], "--rollout.env=tests/_envs.py:Mixed", "--train.steps=3",
               "--rollout.filter_zero_std=true", "--rollout.refill_rounds=1", "--eval.pass_k=2",
               "--rollout.max_staleness=2", "--log.run=a"], tmp_path)
    assert "generator rank 1: done, weight version 3 after 3 steps" in out.stdout + out.stderr
    rows = rows_of(tmp_path / "a")
    check_episode_rows(rows)
    # two batches ahead: a step's first round is up to two versions old (its refill rounds are
    # generated after the last sync)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2]
    for r in rows:  # the histogram: every completion is 0, 1 or 2 versions old
        assert sum(r[f"rollout/staleness_{j}"] for j in range(3)) == pytest.approx(1)
        assert r["perf/gen_idle_s"] >= 0 and r["perf/wait_s"] >= 0  # each side's wait
    assert rows[0]["rollout/staleness"] == 0
    assert all(0 < r["rollout/staleness"] <= 2 for r in rows[1:])
    assert "eval/pass@2" in rows[-1]
    assert rows[0]["mismatch/abs_diff"] < 1e-3  # vLLM's episode logprobs are the trainer's
    assert all(r["rollout/prompts_drawn"] == 8 * (r["rollout/refill_rounds"] + 1) for r in rows)  # B = 8
