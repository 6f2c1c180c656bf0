"""config.py and train_grpo's validation: typos, types and impossible values fail before any work."""
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

import config
import checks
from conftest import ROOT


@dataclass
class Loss:
    name: str = "grpo"
    beta: float = 0.04
    cap: float | None = None
    kwargs: dict = field(default_factory=dict)


@dataclass
class Train:
    steps: int = 10
    betas: tuple = (0.9, 0.99)
    deterministic: bool = False


def sections():
    return {"loss": Loss(), "train": Train()}


def test_file_then_cli_overrides(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import os\nloss.beta = 0\ntrain.steps = 3\nloss.kwargs = {'a': 1}\n")
    cfg = config.parse(sections(), [str(f), "--loss.cap=0.3", "--train.deterministic=true", "--train.steps=7",
                                    "--train.betas=(0.8,0.9)"])
    assert cfg["loss"] == Loss(beta=0.0, cap=0.3, kwargs={"a": 1})
    assert cfg["train"] == Train(steps=7, betas=(0.8, 0.9), deterministic=True)
    assert isinstance(cfg["loss"].beta, float)


@pytest.mark.parametrize("argv,message", [
    (["--loss.bta=1"], "unknown config key 'loss.bta' (did you mean 'loss.beta'?)"),
    (["--los.beta=1"], "unknown config section 'los' (did you mean 'loss'?)"),
    (["--train.steps=abc"], "train.steps: cannot parse 'abc' as int"),
    (["--train.steps=1.5"], "train.steps: expected int, got 1.5"),
    (["--train.steps"], "expected --section.field=value"),
    (["no/such/config.py"], "config file not found: no/such/config.py"),
])
def test_cli_errors(argv, message):
    with pytest.raises(config.ConfigError) as e:
        config.parse(sections(), argv)
    assert message in str(e.value)


def test_a_config_includes_its_base_relative_to_itself(tmp_path):
    """`include("base.py")` inside a config file runs that file there, named relative to the
    including file (so a recipe in configs/ includes "tiny.py" wherever it is launched from); a
    missing one names its path."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.py").write_text("loss.beta = 0.5\ntrain.steps = 7\n")
    (tmp_path / "sub" / "mid.py").write_text('include("base.py")\ntrain.steps = 9\n')
    (tmp_path / "top.py").write_text('include("sub/mid.py")\nloss.beta = 0.25\n')
    out = config.parse(sections(), [str(tmp_path / "top.py")])
    assert (out["loss"].beta, out["train"].steps) == (0.25, 9)
    (tmp_path / "bad.py").write_text('include("nope.py")\n')
    with pytest.raises(config.ConfigError, match=f"config file not found: {tmp_path}/nope.py"):
        config.parse(sections(), [str(tmp_path / "bad.py")])


@pytest.mark.parametrize("code,message", [
    ("loss.bta = 1\n", "did you mean 'loss.beta'"),
    ("lsos.beta = 1\n", "did you mean 'loss'"),
    ("steps = 3\n", "top-level name 'steps' is not a config section"),
    ("train.deterministic = 'yes'\n", "train.deterministic"),
    ("loss.beta = 'high'\n", "loss.beta"),
])
def test_file_errors(tmp_path, code, message):
    f = tmp_path / "c.py"
    f.write_text(code)
    with pytest.raises(config.ConfigError) as e:
        config.parse(sections(), [str(f)])
    assert message in str(e.value)


def run_grpo(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}  # W&B: not logged in
    return subprocess.run([sys.executable, "train_grpo.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args,message", [
    (["--loss.name=grpoo"], "did you mean 'grpo'"),
    (["--loss.kwargs={'bta': 0.1}"], "loss.kwargs"),
    (["--rollout.group_size=1"], "group advantages need at least 2 samples"),
    (["--dist.generator_ranks=1"], "must be < world size 1 (at least one trainer rank)"),
    (["--rollout.prompts_per_step=0"], "rollout.prompts_per_step=0 must be >= 1"),
    (["--model.path=no/such/dir"], "no config.json in no/such/dir"),
    (["--optim.shedule=cosine"], "did you mean 'optim.schedule'"),
    (["--log.wandb=true"], "log.wandb=True: no W&B API key"),  # the extra is installed; missing: test_run.py
])
@pytest.mark.slow  # a trainer in a subprocess: the CLI exit path (the same checks run in-process in the fast tier)
def test_train_grpo_rejects_bad_config_before_loading(args, message):
    """Each bad input fails fast (no model, no vLLM) with a message naming the field."""
    res = run_grpo("configs/tiny.py", "--dist.generator_ranks=0", *args, timeout=60)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr  # one clear line, and nothing heavy was started


# ---- every shipped config parses and validates, offline, at the world size its header launches ----

CONFIGS = sorted((ROOT / "configs").glob("*.py"))


def intended_world_size(path):
    """The `--nproc_per_node=N` of the first launch line in the config's header comment; plain `python` = 1."""
    import re
    launch = next(line for line in path.read_text().splitlines() if re.search(r"train_\w+\.py", line))
    m = re.search(r"--nproc_per_node=(\d+)", launch)
    return int(m.group(1)) if m else 1


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_parses_and_validates_offline(path, monkeypatch):
    """parse_config + checks.grpo (checks.sft for sft_*), no model loaded, and no network: a hub name such as
    Qwen/Qwen2.5-1.5B-Instruct must pass validation on a machine that cannot reach the hub."""
    import socket
    import train_grpo
    import train_sft

    def no_network(*a, **k):
        raise AssertionError(f"{path.name}: validation tried to open a network connection")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.chdir(ROOT)  # configs and launch lines use paths relative to the repo root
    trainer = train_sft if path.name.startswith("sft_") else train_grpo
    cfg = trainer.parse_config([str(path.relative_to(ROOT))])
    (checks.sft if trainer is train_sft else checks.grpo)(cfg, intended_world_size(path))
    one_gpu = path.name.endswith("_1gpu.py")
    if trainer is train_grpo and path.name.startswith("gsm8k_") and not one_gpu:
        assert intended_world_size(path) == 8 and cfg.data.name == "gsm8k"  # built on configs/gsm8k.py


@pytest.mark.parametrize("loss", sorted(__import__("losses").LOSSES))
def test_every_loss_runs_on_every_shipped_grpo_config(loss, monkeypatch, capsys):
    """`--loss.name=<loss>` on any GRPO config validates: kwargs that only other losses take (tiny.py's GRPO `agg`)
    are dropped with a one-line notice naming them; a key no loss takes is still an error with a did-you-mean."""
    import losses
    import train_grpo
    monkeypatch.chdir(ROOT)
    for path in CONFIGS:
        if path.name.startswith("sft_"):
            continue
        cfg = train_grpo.parse_config([str(path.relative_to(ROOT)), f"--loss.name={loss}"])
        checks.grpo(cfg, intended_world_size(path))
        kw = checks.loss_kwargs(cfg)
        assert set(kw) <= set(__import__("inspect").signature(losses.LOSSES[loss]).parameters), (path.name, kw)
        dropped = set(cfg.loss.kwargs) - set(kw)
        err = capsys.readouterr().err
        assert (f"note: loss.kwargs {sorted(dropped)} dropped" in err) == bool(dropped), (path.name, err)
    cfg = train_grpo.parse_config(["configs/tiny.py", f"--loss.name={loss}", '--loss.kwargs={"clip_lwo": 0.1}'])
    with pytest.raises(config.ConfigError, match="clip_lwo"):
        checks.grpo(cfg, 1)


@pytest.mark.parametrize("env", sorted(__import__("envs").BUILTIN))
def test_every_env_runs_on_every_shipped_grpo_config(env, monkeypatch, capsys):
    """`--rollout.env=<env>` on any GRPO config validates, as every loss does: options episodes do
    not take (tiny.py's overlong_cache) are dropped, and a reply budget larger than the episode's
    (gsm8k.py's) raises the episode's, each with a one-line note instead of refused."""
    import train_grpo
    monkeypatch.chdir(ROOT)
    for path in CONFIGS:
        if path.name.startswith("sft_"):
            continue
        cfg = train_grpo.parse_config([str(path.relative_to(ROOT)), f"--rollout.env={env}"])
        had, short = (cfg.rollout.overlong_cache,
                      cfg.rollout.max_episode_tokens < cfg.rollout.max_tokens)
        checks.grpo(cfg, intended_world_size(path))
        err = capsys.readouterr().err
        assert (cfg.rollout.overlong_cache == 0
                and cfg.rollout.max_episode_tokens >= cfg.rollout.max_tokens)
        assert ("note: rollout.overlong_cache" in err) == bool(had), path.name
        assert ("note: rollout.max_episode_tokens" in err) == short, path.name


def test_every_builtin_loss_has_a_gsm8k_recipe():
    """configs/gsm8k_<loss>.py exists for each built-in loss (conftest.BUILTIN_LOSSES: a loss a fork
    adds needs no recipe), names its section of docs/losses-spec.md, and selects that loss."""
    import train_grpo
    from conftest import BUILTIN_LOSSES
    for name in BUILTIN_LOSSES:
        path = ROOT / "configs" / f"gsm8k_{name}.py"
        assert path.exists(), f"missing recipe {path.name}"
        text = path.read_text()
        assert "docs/losses-spec.md section" in text, path.name
        cfg = train_grpo.parse_config([str(path)])
        assert cfg.loss.name == name and cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct", path.name
        assert cfg.log.run == f"gsm8k_{name}", path.name


def test_a_wrong_world_size_fails_validation():
    """The check above can fail: the 8-GPU recipe needs more ranks than its 2 generator ranks."""
    import train_grpo
    cfg = train_grpo.parse_config([str(ROOT / "configs" / "gsm8k_dapo.py")])
    with pytest.raises(config.ConfigError):
        checks.grpo(cfg, 2)


def test_compile_with_tensor_parallel_fails_validation():
    """dist.compile=True under TP is refused at config time (tracing the DTensor blocks fails); the default, False,
    passes there."""
    import train_grpo
    import train_sft
    for mod, check in ((train_grpo, checks.grpo), (train_sft, checks.sft)):
        base = [str(ROOT / "configs" / ("tiny.py" if mod is train_grpo else "sft_tiny.py")), "--dist.tp=2"]
        with pytest.raises(config.ConfigError, match="dist.compile=True must be False with dist.tp=2"):
            check(mod.parse_config([*base, "--dist.compile=true"]), 2)
        check(mod.parse_config(base), 2)


def test_staleness_takes_any_bound_and_refuses_a_negative_one(tiny_ckpt):
    import train_grpo
    base = [str(ROOT / "configs" / "tiny.py"), f"--model.path={tiny_ckpt}"]
    for k in (0, 1, 2, 4):
        checks.grpo(train_grpo.parse_config([*base, f"--rollout.max_staleness={k}"]), 1)
    with pytest.raises(config.ConfigError, match="rollout.max_staleness=-1 must be >= 0"):
        checks.grpo(train_grpo.parse_config([*base, "--rollout.max_staleness=-1"]), 1)


def test_inflight_updates_need_dedicated_generator_ranks_generating_ahead(tiny_ckpt):
    import train_grpo
    base = [str(ROOT / "configs" / "tiny.py"), f"--model.path={tiny_ckpt}",
            "--rollout.inflight_updates=true"]
    cases = ((["--dist.generator_ranks=0", "--rollout.max_staleness=1"], 1, "not 0"),
             (["--dist.generator_ranks=1", "--rollout.max_staleness=0"], 2, r"not 0\)"))
    for extra, world, wrong in cases:
        with pytest.raises(config.ConfigError,
                           match=f"rollout.inflight_updates=True needs .*{wrong}"):
            checks.grpo(train_grpo.parse_config([*base, *extra]), world)
    ok = [*base, "--dist.generator_ranks=1", "--rollout.max_staleness=2"]
    checks.grpo(train_grpo.parse_config(ok), 2)


def test_loss_correction_names_a_rule_or_a_user_file_and_a_threshold_above_one(tiny_ckpt, tmp_path):
    import train_grpo
    base = [str(ROOT / "configs" / "tiny.py"), f"--model.path={tiny_ckpt}"]
    for name in ("tis", "seq_tis", "icepop", "seq_mis", "geo_mask"):
        checks.grpo(train_grpo.parse_config([*base, f"--loss.correction={name}"]), 1)
    (tmp_path / "rule.py").write_text("def half(d, mask, c):\n    return 0.5 + 0 * d\n")
    rule = f"--loss.correction={tmp_path / 'rule.py'}:half"
    checks.grpo(train_grpo.parse_config([*base, rule]), 1)
    with pytest.raises(config.ConfigError,
                       match="loss.correction: unknown correction 'ice_pop'.*'icepop'"):
        checks.grpo(train_grpo.parse_config([*base, "--loss.correction=ice_pop"]), 1)
    with pytest.raises(config.ConfigError, match="loss.correction_c=1.0 must be > 1"):
        checks.grpo(train_grpo.parse_config([*base, "--loss.correction_c=1.0"]), 1)


def test_simple_grpo_warns_when_old_logprobs_would_matter(capsys, tiny_ckpt):
    """SimpleGRPO's ratio is always 1 (it ignores old_logprobs): stale batches or several updates per batch get a
    warning at config time, naming the fields; on-policy with one update it says nothing."""
    import train_grpo
    base = [str(ROOT / "configs" / "tiny.py"), f"--model.path={tiny_ckpt}", "--loss.name=simple_grpo",
            "--loss.kwargs={}"]
    checks.grpo(train_grpo.parse_config(base), 1)
    assert "simple_grpo" not in capsys.readouterr().err
    for extra in ("--rollout.max_staleness=1", "--train.ppo_epochs=2", "--train.minibatches=2"):
        checks.grpo(train_grpo.parse_config([*base, extra]), 1)
        err = capsys.readouterr().err
        assert "warning: loss.name='simple_grpo' ignores old logprobs" in err and extra[2:].split("=")[0] in err
    # staleness with a correction: the correction weighs the stale tokens
    stale_tis = ["--rollout.max_staleness=1", "--loss.correction=tis"]
    checks.grpo(train_grpo.parse_config([*base, *stale_tis]), 1)
    assert "simple_grpo" not in capsys.readouterr().err


def test_load_object_names_what_failed(tmp_path):
    # shadows nanoforge's data
    (tmp_path / "data.py").write_text("def load(source, split):\n    return []\n")
    with pytest.raises(config.ConfigError, match="module name 'data' is taken by"):
        config.load_object(f"{tmp_path}/data.py:load", "data.name")
    (tmp_path / "broken_rewards.py").write_text("import no_such_package\n")
    with pytest.raises(config.ConfigError,
                       match=r"rollout.rewards\['x'\]: cannot load .*ModuleNotFoundError"):
        config.load_object(f"{tmp_path}/broken_rewards.py:R", "rollout.rewards['x']")
    assert config.load_object("json:dumps", "f") is json.dumps


def test_named_resolves_builtins_and_user_files_the_same_way(tmp_path):
    """config.named: the one loader of every extension point. A built-in's name, a module or a file;
    a typo names the closest built-in and says how to name one's own."""
    assert config.named("b", {"a": 1, "b": 2}, "loss.name", "loss") == 2
    assert config.named("json:dumps", {"a": 1}, "loss.name", "loss") is json.dumps
    (tmp_path / "my_adv.py").write_text("def centred(rewards, batch):\n"
                                        "    return rewards - rewards.mean()\n")
    assert (config.named(f"{tmp_path}/my_adv.py:centred", {}, "loss.adv", "estimator").__name__
            == "centred")
    with pytest.raises(config.ConfigError,
                       match=r"loss.adv: unknown estimator 'rlo' \(did you mean 'rloo'\?\); or"):
        config.named("rlo", {"rloo": 1, "grpo": 2}, "loss.adv", "estimator")
