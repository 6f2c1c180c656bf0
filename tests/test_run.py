"""run.py, the bookkeeping both trainers share, through the real commands where a user meets it: `--help` and
`--print-config`, a user's reward and dataset named in the config, bad paths that fail before anything is created,
and W&B (offline) and TensorBoard logs read back with each tool's own reader against metrics.jsonl."""
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import checks
from conftest import ROOT, GSM8K_DIR
import config
import run


def trainer(script, *args, timeout=180, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, script, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ---- --help and --print-config -----------------------------------------------------------------
@pytest.mark.slow  # a trainer in a subprocess: the CLI exit path (the same checks run in-process in the fast tier)
@pytest.mark.parametrize("script,cfg", [("train_grpo.py", "configs/tiny.py"), ("train_sft.py", "configs/sft_tiny.py")])
def test_help_lists_every_field_with_default_type_and_comment(script, cfg):
    res = trainer(script, cfg, "--help", timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    mod = __import__(script.removesuffix(".py"))
    sections = vars(mod.parse_config([str(ROOT / cfg)]))
    for name, obj in sections.items():
        assert f"[{name}]" in res.stdout
        for f in dataclasses.fields(obj):
            line = next((ln for ln in res.stdout.splitlines() if ln.lstrip().startswith(f"--{name}.{f.name}=")), None)
            assert line is not None, f"--help misses {name}.{f.name}"
            assert f"={getattr(obj, f.name)!r}" in line and " # " in line, line  # the config file's value, a comment
    if script == "train_grpo.py":
        assert "--rollout.prompts_per_step=32" in res.stdout and "B: prompts per optimizer step" in res.stdout
        # a comment continued on the next source line is kept whole
        assert '"path/file.py:Name" (see rollout.py)' in res.stdout


@pytest.mark.slow  # a trainer in a subprocess: the CLI exit path (the same checks run in-process in the fast tier)
def test_print_config_prints_the_resolved_config_and_loads_nothing(tmp_path):
    res = trainer("train_grpo.py", "configs/tiny.py", "--optim.lr=1e-4", f"--log.out_dir={tmp_path}",
                  f"--model.path=tiny:{tmp_path}/init", "--print-config", timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    import train_grpo
    want = config.to_dict(vars(train_grpo.parse_config([str(ROOT / "configs/tiny.py"), "--optim.lr=1e-4",
                                                         f"--log.out_dir={tmp_path}",
                                                         f"--model.path=tiny:{tmp_path}/init"])))
    assert json.loads(res.stdout) == json.loads(json.dumps(want))
    assert list(tmp_path.iterdir()) == []  # no checkpoint made, no run directory
    bad = trainer("train_grpo.py", "configs/tiny.py", "--rollout.group_size=1", "--print-config", timeout=60)
    assert bad.returncode != 0 and "group advantages need at least 2 samples" in bad.stderr  # validated first


# ---- bad inputs fail before anything is created -------------------------------------------------
@pytest.mark.slow  # a trainer in a subprocess: the CLI exit path (the same checks run in-process in the fast tier)
def test_model_path_typo_creates_nothing(tmp_path):
    """The exact command from the issue: a typo in --model.path once trained a random model made at the typo."""
    res = trainer(str(ROOT / "train_grpo.py"), str(ROOT / "configs/tiny.py"), "--model.path=my-models/typo",
                  f"--log.out_dir={tmp_path / 'out'}", timeout=60, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode != 0
    assert "model.path='my-models/typo': no such local checkpoint" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []  # neither my-models/typo nor a run directory
    local = trainer("train_grpo.py", "configs/tiny.py", f"--model.path={tmp_path}/typo", timeout=60)
    assert local.returncode != 0 and f"no config.json in {tmp_path}/typo" in local.stderr
    assert list(tmp_path.iterdir()) == []


def test_tiny_models_differ_by_seed_and_one_directory_holds_one(tmp_path):
    """A second `tiny:` model (a teacher beside the student) is another model: the seed is in the
    spec."""
    from safetensors.torch import load_file
    a, b = run.resolve_model(f"tiny:{tmp_path}/a"), run.resolve_model(f"tiny:{tmp_path}/b@1")
    assert run.resolve_model(f"tiny:{tmp_path}/a@0") == a  # @0 is the default, made once
    wa, wb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    assert wa.keys() == wb.keys()
    assert not any(wa[k].equal(wb[k]) for k in wa if k.endswith("proj.weight"))
    with pytest.raises(config.ConfigError,
                       match=r"distill.teacher=tiny:.*/a@2: .* holds the tiny model of seed 0"):
        run.resolve_model(f"tiny:{tmp_path}/a@2", field="distill.teacher")


@pytest.mark.parametrize("args,message", [
    (["--data.name=gsm8k", "--data.source=missing.jsonl"], "data.source: no such file or directory: missing.jsonl"),
    (["--data.name=gsm8k", f"--data.source={GSM8K_DIR}", "--data.eval_source=nope/test.jsonl"],
     "data.eval_source: no such file or directory: nope/test.jsonl"),
    (["--data.name=gsm9k"], "data.name: unknown dataset 'gsm9k' (did you mean 'gsm8k'?)"),
    (["--data.name=no_such_module:load"], "data.name: cannot load 'no_such_module:load' (ModuleNotFoundError"),
    (["--rollout.rewards={'mth': 1.0}"],
     "rollout.rewards['mth']: unknown reward 'mth' (did you mean 'math'?)"),
    (["--rollout.rewards={'json:dumps': 'x'}"], "rollout.rewards['json:dumps']: the weight must be a number"),
    (["--rollout.rewards={'os:sep': 1.0}"], "rollout.rewards['os:sep']: 'os:sep' is a str, not a callable"),
    (["--rollout.rewards={'missing.py:R': 1.0}"], "cannot load 'missing.py:R' (FileNotFoundError"),
])
@pytest.mark.slow  # a trainer in a subprocess: the CLI exit path (the same checks run in-process in the fast tier)
def test_bad_data_and_reward_names_fail_before_loading(tmp_path, args, message):
    res = trainer("train_grpo.py", "configs/tiny.py", f"--model.path=tiny:{tmp_path}/init",
                  f"--log.out_dir={tmp_path}", *args, timeout=60)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a trainer in a subprocess: the CLI exit path (the same checks run in-process in the fast tier)
def test_reward_kwargs_are_checked_when_instantiated(tmp_path):
    res = trainer("train_grpo.py", "configs/tiny.py", f"--model.path=tiny:{tmp_path}/init",
                  f"--log.out_dir={tmp_path}", "--rollout.rewards={'think': {'weight': 1.0, 'tagg': 'x'}}", timeout=60)
    assert res.returncode != 0 and "rollout.rewards: think({'tagg': 'x'}) failed" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "tiny").exists()  # no run directory


def test_logging_extra_missing_is_a_config_error_mock_missing_package(monkeypatch):
    """wandb and tensorboard are installed for the tests (make test installs the extra), so their absence is
    simulated: importlib.util.find_spec answers None for them, as it does where the extra is not installed."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("wandb", "tensorboard") else real(n, *a))
    import train_grpo
    for flag in ("wandb", "tensorboard"):
        cfg = train_grpo.parse_config([str(ROOT / "configs/tiny.py"), f"--log.{flag}=true"])
        with pytest.raises(config.ConfigError, match=rf"log.{flag}=True needs `pip install {flag}`.*make extras"):
            checks.grpo(cfg, 1)


# ---- a user's dataset, named in the config ----------------------------------------------------------
LOADER = '''import json


def load(source, split):
    """Lines of {"q": ..., "a": ...}; this file's own format, mapped to nanoforge's records."""
    rows = [json.loads(line) for line in open(source)]
    return [{"question": r["q"], "solution": f"The answer is {r['a']}.", "target": r["a"]} for r in rows]
'''


@pytest.mark.slow
def test_own_dataset_loader_trains_and_counts_malformed_rows(tmp_path):
    (tmp_path / "my_data.py").write_text(LOADER)
    good = [{"q": f"What is {a} plus {b}?", "a": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    lines = [json.dumps(r) for r in good] + [json.dumps({"q": "", "a": "1"})]  # one malformed row (empty question)
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    res = trainer("train_grpo.py", "configs/tiny.py", f"--model.path=tiny:{tmp_path}/init",
                  f"--data.name={tmp_path}/my_data.py:load", f"--data.source={tmp_path}/train.jsonl",
                  "--data.max_bad_fraction=0.05", "--train.steps=2", "--rollout.prompts_per_step=4",
                  "--eval.num_problems=8", f"--log.out_dir={tmp_path}", "--log.run=own", timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "skipped 1/65 malformed rows (first: row 64: ValueError: empty question)" in res.stderr
    prompts = rows(tmp_path / "own" / "prompts.jsonl")
    assert [len(p["ids"]) for p in prompts] == [4, 4] and all(0 <= i < 64 for p in prompts for i in p["ids"])
    assert rows(tmp_path / "own" / "metrics.jsonl")[-1]["step"] == 2


# ---- W&B (offline) and TensorBoard: every metric, the same steps ---------------------------------------
def wandb_records(path, block=32768):
    """The records of a W&B transaction log (.wandb: a 7-byte header, then LevelDB-style log blocks of
    32 KiB holding length-prefixed chunks of wandb's own protobuf Record), parsed with wandb's schema."""
    from wandb.proto import wandb_internal_pb2 as pb
    buf = Path(path).read_bytes()
    assert buf[:4] == b":W&B"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(buf):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(buf[pos + 4:pos + 6], "little"), buf[pos + 6]
        chunk, pos = chunk + buf[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


@pytest.mark.slow
def test_wandb_offline_and_tensorboard_hold_every_metric(tmp_path):
    res = trainer("train_grpo.py", "configs/tiny.py", f"--model.path=tiny:{tmp_path}/init", "--train.steps=3",
                  "--rollout.prompts_per_step=4", "--eval.num_problems=8", "--eval.every=2", f"--log.out_dir={tmp_path}",
                  "--log.run=logged", "--log.wandb=true", "--log.tensorboard=true", timeout=240,
                  env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "logged"
    want = {}  # metric -> {step: value}, from metrics.jsonl
    for row in rows(out / "metrics.jsonl"):
        for k, v in row.items():
            if k != "step":
                want.setdefault(k, {})[row["step"]] = v
    assert {0, 1, 2, 3} == {s for steps in want.values() for s in steps} and "eval/pass@1" in want
    # TensorBoard, through its own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(want)
    for k, steps in want.items():
        got = {e.step: e.value for e in acc.Scalars(k)}
        assert got.keys() == steps.keys(), k
        assert all(math.isclose(got[s], v, rel_tol=1e-6, abs_tol=1e-30) or (math.isnan(got[s]) and math.isnan(v))
                   for s, v in steps.items()), k
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config_text) == json.loads((out / "config.json").read_text())
    # W&B, the offline transaction log through wandb's protobuf schema
    [log] = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    recs = wandb_records(log)
    history = {}
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_") and key != "step":
                    history.setdefault(key, {})[r.history.step.num] = json.loads(item.value_json)
    assert history.keys() == want.keys()
    for k, steps in want.items():
        assert history[k].keys() == steps.keys(), k
        assert all(math.isclose(history[k][s], v, rel_tol=1e-9) for s, v in steps.items() if not math.isnan(v)), k
    [run_rec] = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    attached = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in run_rec.config.update}
    resolved = json.loads((out / "config.json").read_text())
    assert all(attached[name].get("value", attached[name]) == resolved[name] for name in resolved), attached.keys()
