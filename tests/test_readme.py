"""README.md's and docs/'s code is real: the worked examples marked `<!-- readme-example: NAME -->` are executed and
checked against the library (the new loss against DAPOLoss on the spec's fixture F), every block marked
`<!-- cpu-test -->` runs as written, and every relative link (a file, or a heading in one) resolves."""
import re

import pytest
import torch

import losses
import checks
from conftest import ROOT


def readme_block(name):
    """The fenced block right after `<!-- readme-example: NAME -->` in README.md."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- readme-example: {re.escape(name)} -->\s*```(\w+)\n(.*?)```", text, re.S)
    assert m, f"README.md has no block marked readme-example: {name}"
    return m.group(2)


def readme_namespace(name):
    scope = {}
    exec(compile(readme_block(name), f"README.md:{name}", "exec"), scope)
    return scope


# fixture F of ../shared/specs/losses.md section 1 (the pad slot [1, 2] holds junk on purpose)
MASK = torch.tensor([[1., 1, 1], [1, 1, 0]], dtype=torch.float64)
LP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -5.0]]
ADV = torch.tensor([1.0, -0.5], dtype=torch.float64)


def grad_of(loss_fn, lp_values, adv=ADV):
    lp = torch.tensor(lp_values, dtype=torch.float64, requires_grad=True)
    loss, metrics = loss_fn(lp, None, adv, MASK)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_readme_new_loss_equals_dapo_on_policy_gradient():
    """Token-mean PG without IS == DAPO on-policy (old = sg(lp)) in gradient: -A_i / N (spec E2b)."""
    loss_fn = readme_namespace("new-loss")["TokenMeanPGLoss"]()
    value, grad, metrics = grad_of(loss_fn, LP)
    _, dapo_grad, _ = grad_of(losses.DAPOLoss(), LP)
    torch.testing.assert_close(grad, dapo_grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, torch.tensor([[-0.2, -0.2, -0.2], [0.1, 0.1, 0.0]], dtype=torch.float64))
    # its value is the surrogate -A*lp (token-mean), not DAPO's -A: 0.55 on F, as torchforge REINFORCE E2b
    assert value.item() == pytest.approx(0.55, abs=1e-12) and set(metrics) == {"loss/pg"}
    # padding junk (inf) changes nothing and gets exactly zero gradient
    junk = [row[:] for row in LP]
    junk[1][2] = float("-inf")
    value_j, grad_j, _ = grad_of(loss_fn, junk)
    assert value_j.item() == value.item() and torch.equal(grad_j, grad)
    # and it can fail: a seq-mean-token-mean loss (GRPO's default) gives a different gradient on F
    _, grpo_grad, _ = grad_of(losses.GRPOLoss(beta=0.0), LP)
    assert not torch.allclose(grad, grpo_grad)


def test_readme_new_loss_plugs_into_the_trainer_config(monkeypatch):
    """Registered under a LOSSES key, the README's loss passes train_grpo's validation like any built-in."""
    import train_grpo
    monkeypatch.setitem(losses.LOSSES, "token_pg", readme_namespace("new-loss")["TokenMeanPGLoss"])
    monkeypatch.chdir(ROOT)
    cfg = train_grpo.parse_config(["configs/tiny.py", "--loss.name=token_pg", "--loss.kwargs={}"])
    checks.grpo(cfg, 2)


def test_readme_new_reward_through_safe_call():
    import reward_guard
    reward = readme_namespace("new-reward")["ConcisenessReward"](max_words=4)
    assert reward_guard.safe_call(reward, "q", "one two three", "3")[0] == 1.0
    assert reward_guard.safe_call(reward, "q", "a b c d e f", "3")[0] == pytest.approx(0.5)
    assert reward_guard.safe_call(reward, "q", " ".join("x" * 20), "3")[0] == 0.0


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    """README.md and docs/*.md: each [text](target) that is not a URL names a file that exists (relative to the page),
    and a #fragment names a heading of that file."""
    checked = 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.relative_to(ROOT)}: link to missing {target}"
            if frag:
                heads = {slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                assert frag in heads, f"{page.relative_to(ROOT)}: no heading #{frag} in {dest.name}"
            checked += 1
    assert checked >= 10, checked  # the pages do link to each other


@pytest.mark.slow
def test_readme_cpu_blocks_run(tmp_path):
    """Every ```bash block preceded by `<!-- cpu-test -->`, in README.md and docs/, runs as written (outputs under a
    temp dir)."""
    import json
    import os
    import subprocess
    blocks = [b for page in PAGES for b in re.findall(r"<!-- cpu-test -->\s*```bash\n(.*?)```", page.read_text(), re.S)]
    assert blocks, "README.md has no <!-- cpu-test --> block"
    env = {**os.environ, "NF_OUT": str(tmp_path)}
    for block in blocks:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=240)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "cpu" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "perf/step_s" in r] == [1, 2]
    for run in ("tiny", "tiny_2ranks"):  # the "Run it" commands, 3 steps each, with an HF export
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "perf/step_s" in r] == [1, 2, 3], run
        assert (tmp_path / run / "hf" / "config.json").exists(), run


@pytest.mark.slow
def test_readme_reward_config_runs_without_editing_nanoforge(tmp_path):
    """The README's reward, saved as the user's own file, named in a config: two GRPO steps, scored in a RewardPool
    worker (which must import the file by name), and the logged total is the weighted sum of the logged parts."""
    import json
    import subprocess
    import sys
    (tmp_path / "my_rewards.py").write_text(readme_block("new-reward"))
    line = readme_block("reward-config").replace("my_rewards.py:", f"{tmp_path}/my_rewards.py:")
    (tmp_path / "rewards_cfg.py").write_text(line.replace("'max_words': 200", "'max_words': 20")
                                             .replace('"max_words": 200', '"max_words": 20'))
    res = subprocess.run([sys.executable, "train_grpo.py", "configs/tiny.py", str(tmp_path / "rewards_cfg.py"),
                          f"--model.path=tiny:{tmp_path}/init", "--train.steps=2", "--rollout.prompts_per_step=4",
                          "--eval.num_problems=8", "--rollout.reward_workers=1", f"--log.out_dir={tmp_path}",
                          "--log.run=rw"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "rw" / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 2
    for row in steps:
        assert row["rewards/ConcisenessReward_errors"] == 0 and row["rewards/ConcisenessReward_timeouts"] == 0
        assert row["rollout/reward_mean"] == pytest.approx(row["rewards/math_mean"]
                                                          + 0.2 * row["rewards/ConcisenessReward_mean"], abs=1e-6)


@pytest.mark.slow
def test_readme_new_env_steps_and_runs_two_grpo_steps(tmp_path):
    """The README's env: its contract by hand, then saved as the user's own file and named in rollout.env for two
    colocated GRPO steps, whose episodes it ends (done) or that hit a limit, never an env error."""
    import json
    import subprocess
    import sys
    Hint = readme_namespace("new-env")["Hint"]
    p = {"question": "Ann has 12 pens. She finds 5 more. How many pens now?", "target": "17"}
    assert Hint(p).step("17").reward == 1.0
    env = Hint(p)
    assert env.step("16").messages == [{"role": "user", "content": "Not quite: it ends in 7."}]
    assert env.step("It is 17.").reward == 0.5
    assert Hint(p).step("no number yet").done is False
    (tmp_path / "hint.py").write_text(readme_block("new-env"))
    res = subprocess.run([sys.executable, "train_grpo.py", "configs/tiny.py", f"--rollout.env={tmp_path}/hint.py:Hint",
                          f"--model.path=tiny:{tmp_path}/init", "--train.steps=2", "--rollout.prompts_per_step=4",
                          "--rollout.overlong_cache=0", "--eval.num_problems=8", f"--log.out_dir={tmp_path}",
                          "--log.run=env"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "env" / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 2 and all(r["episode/error_frac"] == 0 and r["episode/turns"] >= 1 for r in steps)
