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


# fixture F of docs/losses-spec.md section 1 (the pad slot [1, 2] holds junk on purpose)
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


@pytest.fixture(autouse=True)
def fresh_user_modules():
    """Each test saves the README's files in its own temp dir; a module imported by file name from
    another one must not be found instead (config.load_object refuses a name that is taken)."""
    import sys
    for name in [m for m in sys.modules if m.startswith("my_")]:
        del sys.modules[name]


def user_files(tmp_path):
    """The README's loss, estimator and dataset saved as a user's own files, and the config lines
    naming them."""
    for file, block in (("my_loss.py", "new-loss"), ("my_adv.py", "new-estimator"),
                        ("my_data.py", "new-dataset")):
        (tmp_path / file).write_text(readme_block(block))
    lines = [readme_block("loss-config"), 'loss.adv = "my_adv.py:discounted_advantages"',
             'data.name = "my_data.py:load"']
    return "\n".join(line.strip().replace('"my_', f'"{tmp_path}/my_') for line in lines) + "\n"


def test_readme_loss_and_estimator_from_user_files_pass_validation(tmp_path, monkeypatch):
    """Named as files in a config, the README's loss and estimator pass train_grpo's validation like
    built-ins, and losses.LOSSES stays as it was: nanoforge is not edited."""
    import train_grpo
    (tmp_path / "user.py").write_text(user_files(tmp_path))
    monkeypatch.chdir(ROOT)
    before = dict(losses.LOSSES)
    cfg = train_grpo.parse_config(["configs/tiny.py", str(tmp_path / "user.py"), "--loss.kwargs={}",
                                   f"--data.source={tmp_path}"])
    checks.grpo(cfg, 1)
    assert cfg.loss.name.endswith("my_loss.py:TokenMeanPGLoss") and losses.LOSSES == before


def test_readme_estimator_is_per_token_and_the_trainer_takes_it(tmp_path, monkeypatch):
    """The README's estimator against a slow loop (a multi-turn mask with a gap: env tokens are not
    trained on), at gamma = 1 equal to GRPO's per-sequence advantage on every trained token, and
    through train_grpo.advantages (named as a file) a (B*G, T) tensor; a wrong shape from an
    estimator is an error naming it."""
    import train_grpo
    fn = readme_namespace("new-estimator")["discounted_advantages"]
    r = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0]])
    mask = torch.tensor([[1., 1, 0, 0, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1], [0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    seq = losses.group_advantages(r).reshape(-1)
    got = fn(r, {"mask": mask})
    for i in range(6):
        for t in range(5):
            after = int(mask[i, t + 1:].sum())
            assert got[i, t] == pytest.approx(float(seq[i]) * 0.9 ** after * float(mask[i, t]),
                                              abs=1e-6)
    torch.testing.assert_close(fn(r, {"mask": mask}, gamma=1.0), seq[:, None] * mask)
    (tmp_path / "my_adv.py").write_text(readme_block("new-estimator"))
    (tmp_path / "bad.py").write_text("def adv(rewards, batch):\n    return rewards[:, :1]\n")
    cfg = train_grpo.parse_config(["configs/tiny.py",
                                   f"--loss.adv={tmp_path}/my_adv.py:discounted_advantages",
                                   "--rollout.overlong_cache=0"])
    adv = train_grpo.advantages(r, {"mask": mask}, None, cfg)
    assert adv.shape == (6, 5) and torch.equal(adv, got)
    cfg.loss.adv = f"{tmp_path}/bad.py:adv"
    with pytest.raises(ValueError, match=r"bad.py:adv' returned advantages of shape \(2, 1\)"):
        train_grpo.advantages(r, {"mask": mask}, None, cfg)


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


SOURCES = [p for p in ROOT.rglob("*")
           if p.is_file() and p.suffix in (".py", ".md", ".sh", ".txt", "")
           and not ({".git", ".venv", "out", "__pycache__", ".pytest_cache"}
                    & set(p.relative_to(ROOT).parts))]


def test_the_repository_stands_alone():
    """A clone has nothing beside it: no file points outside the repository, and every
    `docs/<page>.md#heading` a code comment or config cites exists (the figures behind a constant
    live there, not in the comment)."""
    # spelled in two pieces so that this file passes its own test
    cited, outside = 0, "../" + "shared"
    for path in SOURCES:
        text = path.read_text(errors="replace")
        assert outside not in text, f"{path.relative_to(ROOT)} points outside the repository"
        for page, frag in re.findall(r"docs/([\w-]+\.md)#([\w-]+)", text):
            dest = ROOT / "docs" / page
            assert dest.exists(), f"{path.relative_to(ROOT)} cites missing docs/{page}"
            heads = {slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
            assert frag in heads, f"{path.relative_to(ROOT)}: no heading #{frag} in docs/{page}"
            cited += 1
    assert cited >= 10, cited


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


@pytest.mark.slow
def test_readme_loss_estimator_and_dataset_from_user_files_train(tmp_path):
    """Two GRPO steps with the README's loss, per-token estimator and dataset, each the user's own
    file named in a config: nanoforge untouched. The dataset's problems are what the run trained on
    (prompts.jsonl holds their indices), and the per-token advantages reached the loss (finite,
    non-zero loss/pg on some step)."""
    import json
    import subprocess
    import sys
    import tasks
    problems = tasks.make_arith(40, seed=3)
    for split in ("train", "test"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for p in problems:
                f.write(json.dumps({"q": p["question"], "a": p["target"]}) + "\n")
    (tmp_path / "user.py").write_text(user_files(tmp_path))
    res = subprocess.run([sys.executable, "train_grpo.py", "configs/tiny.py",
                          str(tmp_path / "user.py"), "--loss.kwargs={}",
                          f"--data.source={tmp_path}", f"--model.path=tiny:{tmp_path}/init",
                          "--train.steps=2", "--rollout.prompts_per_step=4",
                          "--eval.num_problems=8", f"--log.out_dir={tmp_path}", "--log.run=user"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x)
             for x in (tmp_path / "user" / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 2 and all(np_finite(r["loss/pg"]) for r in steps)
    # tiny.py's overlong shaping gives the random model a signal
    assert any(r["loss/pg"] != 0 for r in steps)
    ids = [json.loads(x)["ids"]
           for x in (tmp_path / "user" / "prompts.jsonl").read_text().splitlines()]
    assert len(ids) == 2 and all(0 <= i < 40 for step in ids for i in step)


def np_finite(x):
    import math
    return math.isfinite(x)
