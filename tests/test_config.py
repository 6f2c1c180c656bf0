"""config.py and train_grpo's validation: typos, types and impossible values fail before any work."""
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

import config
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
    return subprocess.run([sys.executable, "train_grpo.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--loss.name=grpoo"], "did you mean 'grpo'"),
    (["--loss.kwargs={'bta': 0.1}"], "loss.kwargs"),
    (["--rollout.group_size=1"], "group advantages need at least 2 samples"),
    (["--dist.generator_ranks=1"], "must be < world size 1 (at least one trainer rank)"),
    (["--rollout.prompts_per_step=0"], "rollout.prompts_per_step=0 must be >= 1"),
    (["--model.path=no/such/dir", "--model.make_tiny=false"], "no config.json in no/such/dir"),
    (["--optim.shedule=cosine"], "did you mean 'optim.schedule'"),
    (["--log.wandb=true"], "needs `pip install wandb`"),
])
def test_train_grpo_rejects_bad_config_before_loading(args, message):
    """Each bad input fails fast (no model, no vLLM) with a message naming the field."""
    res = run_grpo("configs/tiny.py", "--dist.generator_ranks=0", *args, timeout=60)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr  # one clear line, and nothing heavy was started
