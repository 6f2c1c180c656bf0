"""Envs for test_episodes.py's end-to-end runs, loaded as "tests/_envs.py:Name" (the path form users write).

Single: the single-turn loop written as an env (the opening prompt is data.prompt_ids', the first reply is final):
a run with it must log exactly the numbers a run without an env logs. Mixed: each problem gets one of the three
built-ins (by its question), so one torchrun run plays all three on a dedicated generator rank.
digit_share: a reward a random tiny model earns in varying amounts, so that every group carries
signal and an update moves.
"""
import zlib

import envs


class Single:
    def __init__(self, problem, seed=0):
        self.problem = problem

    def reset(self):
        return [{"role": "user", "content": self.problem["question"]}]

    def step(self, text):
        return envs.Step([], done=True)


class Mixed:
    def __init__(self, problem, seed=0):
        names = sorted(envs.BUILTIN)
        self.env = envs.BUILTIN[names[zlib.crc32(problem["question"].encode()) % len(names)]](problem, seed)
        self.target = getattr(self.env, "target", None)

    def reset(self):
        return self.env.reset()

    def step(self, text):
        return self.env.step(text)


def digit_share(prompt, response, target):
    return sum(c.isdigit() for c in response) / max(len(response), 1)
