"""Multi-turn episodes: the turn loop and its token bookkeeping, the rollout's half of envs.py's
contract.

With `rollout.env` set, engine.build_generator wraps the engine in `MultiTurn`, and every batch,
refill round and eval plays episodes instead of single completions. An episode is returned as one
generator.Completion whose token_ids are everything after the opening prompt, with a loss mask under
them:

    ids   [ opening prompt ][ reply 1 (sampled) ][ env reply 1 (bridge) ][ reply 2 (sampled) ]
          render(reset())    verbatim, stop token  chat-template delta      verbatim
    mask                     1 1 1 1 1 1 1 1 1 1   0 0 0 0 0 0 0 0 0 0 0    1 1 1 1 1 1 1 1
    logp                     the generator's       0                        the generator's

- Sampled ids are kept verbatim and never decoded and re-encoded: BPE does not round-trip (on
  SmolLM2 the sampled pair [Ġ, the] re-encodes as one token), which would put logprobs on tokens
  the model never sampled.
- An env reply enters as the bridge: render(ANCHOR + reply, with the generation prompt) minus
  render(ANCHOR) cut after its last end-of-turn token. ANCHOR has a system message (SmolLM2 injects
  a default one otherwise) and ends with an assistant turn, so the bridge starts with the template's
  glue after end-of-turn (ChatML's "\\n", which the model never samples) and ends with the next
  assistant header.
- The mask is 1 on sampled tokens only: env tokens are attended to but never trained on. The
  attention mask comes from lengths (packing.make_batch), never from a token id (SmolLM2's pad is
  its eos).
- Turn 0 samples the G replies of each problem from its one opening prompt; turn k >= 1 generates
  one reply from each still-active episode's ids. Each turn's sampling seed is a function of the
  batch's seed and k, so episodes are a pure function of (seed, step), like single-turn batches
  (resume stays exact).

An episode ends as: done (the env said so), length (a reply hit max_tokens: the env is not asked
about half an answer), context (the next turn would not fit `rollout.max_episode_tokens`: checked
before the bridge is appended, so a reply is never cut to fit), turns (`rollout.max_turns` replies
without done), or error (the env raised, ran past `rollout.env_timeout_s`, or returned something
that is not a Step of messages). Its reward is the env's plus `rollout.rewards` on the last reply
(rewards.score); an error scores 0, and every end is counted. A truncated episode is scored like any
other, on its last reply (usually 0): it is the policy's failure, and masking it would hide that
from the gradient; when all G of a problem truncate, the group has no signal and shows in
rollout/zero_std_frac. Env messages are cut to `rollout.max_env_chars`.

Logged (`stats`, every step): turns and tool calls per episode, sampled (trained) tokens per
episode, the share of each end, and the share of episodes whose ids differ from a fresh render of
their messages (template drift or a BPE round-trip: a metric, not an error). rollout/response_len
counts all of an episode's ids after the prompt.
Cost: the update pads every row to the batch's longest episode, so a batch of mostly short episodes
with a few long ones pays for the long ones (SmolLM2, 8 x 8, retry with 3 turns of <= 32 tokens:
1.3x the ids of single-turn, 3.6x the update time); packing rows would remove that.
Left out: per-turn rewards and advantages (one scalar per episode, one advantage over its G
siblings), KV reuse across turns, templates that rewrite earlier turns (Qwen3's thinking; the prefix
check refuses them).
"""
import math
from dataclasses import dataclass, field

import config
import envs
import generator
import reward_guard
import seeds

ENDS = ("done", "length", "context", "turns", "error")
ANCHOR = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
          {"role": "assistant", "content": "c"}]
def turn_seed(seed, turn):
    """Turn `turn`'s generate() seed in a batch seeded `seed` (turn 0 is the batch's own):
    seeds.py."""
    return seed if turn == 0 or seed is None else seeds.seed(seed, "turn", turn)


def env_spec(spec):
    """rollout.env -> (class, kwargs); (None, {}) when empty. A name is a built-in (envs.BUILTIN) or
    "package.module:Class" / "path/to/file.py:Class"; the dict form is {"name": ..., **kwargs}."""
    if not spec:
        return None, {}
    kwargs = dict(spec) if isinstance(spec, dict) else {"name": spec}
    return config.named(kwargs.pop("name", None), envs.BUILTIN, "rollout.env", "env"), kwargs


def make_env(cfg, problem):
    """The env of one episode of `problem`, which it sees with data.instruction appended to the
    question."""
    cls, kwargs = env_spec(cfg.rollout.env)
    try:
        return cls({**problem, "question": problem["question"] + cfg.data.instruction},
                   cfg.train.seed, **kwargs)
    except TypeError as e:  # wrong keyword arguments for the class
        raise config.ConfigError(
            f"rollout.env: {cls.__name__}(problem, seed, **{kwargs}) failed: {e}") from None


def valid_messages(messages, roles=("system", "user", "tool")):
    return isinstance(messages, list) and all(
        isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str)
        for m in messages)


def opening_ids(tok, env):
    """The episode's prompt: the env's opening conversation with the assistant header
    (rollout.load_tasks' prompt_ids)."""
    # may hold worked examples as assistant turns: the prompt, never trained on
    messages = env.reset()
    if not valid_messages(messages, ("system", "user", "tool", "assistant")) or not messages:
        raise ValueError(f"{type(env).__name__}.reset() must return a non-empty list of "
                         f"{{'role': 'system' | 'user' | 'assistant' | 'tool', 'content': str}}, "
                         f"got {messages!r:.200}")
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def end_of_turn(tok, ids):
    """ids up to and including the last end-of-turn (eos) token."""
    return ids[:max((i for i, t in enumerate(ids) if t in tok.eos_token_ids), default=-1) + 1]


def bridge(tok, messages):
    """The ids between a sampled stop token and the next reply: the env's messages as the template
    renders them."""
    base = end_of_turn(tok, tok.apply_chat_template(ANCHOR, tokenize=True))
    full = tok.apply_chat_template(ANCHOR + messages, add_generation_prompt=True, tokenize=True)
    if not base or full[:len(base)] != base:
        raise ValueError(
            "the chat template is not prefix-consistent (it rewrites earlier turns): cannot bridge")
    return full[len(base):]


def guarded_step(env, text, timeout_s):
    """env.step(text) -> (Step, None), or (None, why) when it raised, timed out or returned
    garbage."""
    try:
        with reward_guard.time_limit(timeout_s):
            step = env.step(text)
    except reward_guard.RewardTimeout:
        return None, "timeout"
    except Exception as e:  # the env's bug ends this episode, not the run
        return None, f"raised {type(e).__name__}"
    if (not isinstance(step, envs.Step) or not valid_messages(step.messages)
            or not (step.done or step.messages) or not isinstance(step.info, dict)
            or not (step.reward is None or isinstance(step.reward, (int, float))
                    and math.isfinite(step.reward))):
        return None, "garbage"
    return step, None


@dataclass
class Episode:
    env: object
    messages: list                                 # the conversation so far (re-rendered once at
    #                                                the end)
    ids: list = field(default_factory=list)        # after the opening prompt: sampled replies and
    #                                                bridges
    logp: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    versions: list = field(default_factory=list)   # per id, the weight version that sampled it
    end: str | None = None                         # one of ENDS once it is over
    turns: int = 0
    tool_calls: int = 0
    reward: float | None = None
    error: str | None = None
    text: str = ""                                 # the last reply: what rollout.rewards score


class MultiTurn:
    """An engine that plays episodes (`episodes`); everything else (weight sync, sleep, version) is
    the engine's."""

    def __init__(self, gen, tok, cfg):
        self.gen, self.tok, self.cfg = gen, tok, cfg

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def episodes(self, problems, n, seed, max_tokens, poll=None, **sampling):
        """n episodes per problem -> groups of Completions (token_ids after the opening prompt,
        mask, metadata). poll: an in-flight weight update's hook (generator.py), inside each turn's
        generation and between turns; each token keeps the version that sampled it."""
        eps, version = [], self.gen.version
        for p in problems:
            for _ in range(n):
                env = make_env(self.cfg, p)
                try:
                    eps.append(Episode(env, env.reset()))
                except Exception as e:
                    eps.append(Episode(env, [], end="error",
                                       error=f"reset raised {type(e).__name__}"))
        prompts = [p["prompt_ids"] for p in problems for _ in range(n)]
        # the ends bridge() cuts at
        sampling.update(max_tokens=max_tokens, stop_token_ids=self.tok.eos_token_ids, poll=poll)
        out = [c for g in self.gen.generate([p["prompt_ids"] for p in problems], n=n, seed=seed,
                                            **sampling) for c in g]
        active = [i for i, e in enumerate(eps) if e.end is None]
        out = [out[i] for i in active]
        for turn in range(self.cfg.rollout.max_turns):
            for i, c in zip(active, out):
                self.advance(eps[i], c, turn, max_tokens)
            active = [i for i in active if eps[i].end is None]
            if not active:
                break
            if poll is not None:  # a turn boundary is a token boundary too
                poll()
            out = [g[0] for g in self.gen.generate([prompts[i] + eps[i].ids for i in active],
                                                   n=1, **sampling, seed=turn_seed(seed, turn + 1))]
        return [[self.completion(problems[k], eps[k * n + j], version) for j in range(n)]
                for k in range(len(problems))]

    def advance(self, e, c, turn, max_tokens):
        """One sampled reply into episode e: its ids verbatim, then the env's answer as a bridge, or
        the end."""
        ro = self.cfg.rollout
        e.ids += c.token_ids
        e.logp += c.logprobs
        e.mask += [1] * len(c.token_ids)
        e.versions += c.token_versions()
        e.text, e.turns = c.text, e.turns + 1
        e.messages.append({"role": "assistant", "content": c.text})
        if c.finish_reason == "length":
            e.end = "length"
            return
        step, e.error = guarded_step(e.env, c.text, ro.env_timeout_s)
        if step is None:
            e.end = "error"
            return
        e.tool_calls += bool(step.info.get("tool_call"))
        if step.done:
            e.end, e.reward = "done", step.reward
            return
        if turn + 1 == ro.max_turns:
            e.end = "turns"
            return
        reply = [{**m, "content": m["content"][:ro.max_env_chars]} for m in step.messages]
        ids = bridge(self.tok, reply)
        # the next reply's whole budget must fit
        if len(e.ids) + len(ids) + max_tokens > ro.max_episode_tokens:
            e.end = "context"
            return
        e.messages += reply
        e.ids += ids
        e.logp += [0.0] * len(ids)
        e.mask += [0] * len(ids)
        e.versions += [e.versions[-1]] * len(ids)  # not trained on (mask 0)

    def completion(self, p, e, version):
        # a cut reply has no end of turn to render
        ended = e.messages[:-1] if e.end == "length" else e.messages
        full = self.tok.apply_chat_template(ended, tokenize=True) if ended else []
        differs = end_of_turn(self.tok, full) != end_of_turn(self.tok, p["prompt_ids"] + e.ids)
        target = getattr(e.env, "target", None)
        return generator.Completion(
            prompt_ids=list(p["prompt_ids"]), token_ids=e.ids, text=e.text, logprobs=e.logp,
            mask=e.mask, versions=e.versions if len(set(e.versions)) > 1 else None,
            finish_reason="length" if e.end in ("length", "context", "turns") else "stop",
            generator_version=version,
            metadata={"end": e.end, "turns": e.turns, "tool_calls": e.tool_calls,
                      "env_reward": e.reward, "env_error": e.error,
                      "target": None if target is None else str(target), "rerender": differs})


def stats(groups):
    """Per-step episode metrics over this rank's groups."""
    meta = [c.metadata for g in groups for c in g]
    k = max(len(meta), 1)
    row = {"episode/turns": sum(m["turns"] for m in meta) / k,
           "episode/tool_calls": sum(m["tool_calls"] for m in meta) / k,
           "episode/sampled_tokens": sum(sum(c.mask) for g in groups for c in g) / k,
           "episode/rerender_differs": sum(m["rerender"] for m in meta) / k}
    row.update({f"episode/{end}_frac": sum(m["end"] == end for m in meta) / k for end in ENDS})
    return row
