"""Faults, for real: SIGKILL a 2-rank run while it generates, while it steps the optimizer and while it writes a
checkpoint, then `--ckpt.resume=auto`; NaN losses; a checkpoint write that fails; a rank that dies; bad configs
and bad data. The real commands run in subprocesses; the tests assert on exit codes, messages and metrics.

Faults are injected with $NANOFORGE_FAULT (dist.fault): `kill_<point>@<step>` SIGKILLs the rank that reaches the
point (no handler runs, as with kill -9), `nan@<step>` makes that step's loss NaN, `enospc@<step>` sends that
checkpoint's write to /dev/full (a real ENOSPC from the kernel). Steps in the spec are loop indices (0-based), except
checkpoint points, which use the checkpoint's step number.

Runs are shared to fit the time budget: one 2-rank SFT run (with a NaN step) is the oracle for an SFT run killed
mid-checkpoint and resumed, and its export is the GRPO start (so rewards and gradients are not all zero); one GRPO
run is the oracle for a GRPO run killed twice (generator rank mid-generation, trainer rank mid-optimizer step) and
resumed twice (past a partial checkpoint), and the check of everything a dedicated-generator run logs. Oracle:
deterministic mode reproduces the uninterrupted run's metrics and prompt ids step for step.
"""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import checks
from conftest import ROOT, GSM8K_DIR
import checkpoint
import config
import data
import rollout
import train_grpo
import train_sft

SFT_STEPS, SFT_CKPT = 40, 10
SFT = ["configs/sft_tiny.py", f"--train.steps={SFT_STEPS}", "--train.batch_size=32", "--optim.warmup_steps=5",
       "--optim.lr=3e-3", "--eval.every=0", "--eval.num_problems=16", "--eval.stop_at_accuracy=0",
       "--data.max_digits=1", "--data.eval_min_digits=1", "--data.eval_max_digits=1", "--train.deterministic=true",
       f"--ckpt.every={SFT_CKPT}", "--log.plot_every_s=1e9"]
GRPO_STEPS = 6
GRPO = ["configs/tiny.py", "--dist.generator_ranks=1", "--rollout.backend=vllm", "--rollout.prompts_per_step=8", "--rollout.group_size=4", "--rollout.max_tokens=20",
        "--eval.num_problems=16", "--eval.every=0", "--rollout.kv_cache_mb=32", "--dist.timeout_s=60",
        f"--train.steps={GRPO_STEPS}", "--ckpt.every=2", "--train.deterministic=true", "--optim.warmup_steps=2",
        "--optim.schedule=cosine", "--optim.lr=3e-3", "--optim.weight_decay=0.1", "--loss.entropy_coef=0.01",
        "--data.min_digits=1", "--data.max_digits=1", "--log.plot_every_s=1e9"]
# every trained row logs these, finite (a step made NaN on purpose aside)
LOGGED = ["rollout/reward_mean", "rollout/reward_std", "rollout/accuracy", "rollout/response_len", "loss/pg",
          "loss/clip_frac", "loss/kl", "loss/entropy", "train/grad_norm", "train/lr", "mismatch/abs_diff",
          "mismatch/kl", "rollout/staleness", "perf/gen_s", "perf/train_s", "perf/sync_s", "perf/step_s",
          "perf/tokens_per_s", "train/skipped_steps", "rewards/math_errors"]
# metrics that depend on the weights, the optimizer state, the schedule, the data and the sampling seeds
GRPO_KEYS = ["rollout/reward_mean", "rollout/response_len", "loss/entropy", "loss/pg", "train/grad_norm", "train/lr",
             "train/skipped_steps", "rollout/staleness", "eval/pass@1"]
SFT_KEYS = ["sft/loss", "train/grad_norm", "train/lr", "train/skipped_steps", "sft/eval_loss", "eval/pass@1"]


def launch(script, args, out, run, nproc=2, fault=None, timeout=300):
    """-> (exit code, stdout+stderr, wall seconds, end time). nproc=1 is plain python (a world of one)."""
    cmd = [sys.executable, script] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    env = {k: v for k, v in os.environ.items() if k != "NANOFORGE_FAULT"}
    env.update(OMP_NUM_THREADS="1" if nproc > 1 else env.get("OMP_NUM_THREADS", "2"),
               **({"NANOFORGE_FAULT": fault} if fault else {}))
    t0 = time.time()
    p = subprocess.run([*cmd, *args, f"--log.out_dir={out}", f"--log.run={run}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.time() - t0, time.time()


def ok(res):
    assert res[0] == 0, res[1][-5000:]
    return res[1]


def rows(out, run, name="metrics.jsonl"):
    return [json.loads(line) for line in (Path(out) / run / name).read_text().splitlines()]


def train_rows(out, run):
    return [r for r in rows(out, run) if "perf/step_s" in r]


def same(a, b, keys, rel=0.0):
    """Rows equal on `keys` (NaN equals NaN: a skipped step must be skipped again)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for k in keys:
            if k in ra or k in rb:
                x, y = ra[k], rb[k]
                assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=rel, abs=1e-9), \
                    (ra["step"], k, x, y)


def checkpoints(out, run):
    d = Path(out) / run / "ckpt"
    return sorted(p.name + ("" if (p / "COMPLETE").exists() else " (partial)") for p in d.iterdir())


def sigkill_time(log):
    return float(re.search(r"NANOFORGE_FAULT \S+: SIGKILL rank \d+ at t=([\d.]+)", log)[1])


# ---------------------------------------------------------------------------------------------------------------
# SFT: an uninterrupted 2-rank run with a NaN step, and the same run killed mid-checkpoint-write, then resumed
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    common = [*SFT, f"--model.path={tiny_ckpt}", "--ckpt.resume=auto"]
    straight = ok(launch("train_sft.py", common, out, "sft", fault="nan@3"))
    killed = launch("train_sft.py", common, out, "sft_k", fault=f"nan@3,kill_ckpt@{2 * SFT_CKPT}")
    ckpts = checkpoints(out, "sft_k")
    resumed = ok(launch("train_sft.py", common, out, "sft_k", fault="nan@3"))
    return dict(out=out, straight=straight, killed=killed, ckpts=ckpts, resumed=resumed)


@pytest.mark.slow
def test_sft_nan_step_is_skipped_counted_and_logged(sft):
    assert "ckpt.resume=auto: no complete checkpoint" in sft["straight"]  # auto with nothing to resume: step 0
    rs = train_rows(sft["out"], "sft")
    assert [r["train/skipped_steps"] for r in rs[:6]] == [0, 0, 0, 1, 1, 1]
    assert math.isnan(rs[3]["sft/loss"]) and math.isnan(rs[3]["train/grad_norm"])  # the bad batch is on record
    assert "step 4: non-finite loss or grad norm, optimizer step skipped (sft/loss=nan" in sft["straight"]
    assert all(math.isfinite(r["sft/loss"]) for r in rs[4:])  # the weights were never touched by the NaN
    assert rs[-1]["sft/loss"] < 0.5 * rs[0]["sft/loss"]


@pytest.mark.slow
def test_sft_sigkill_mid_checkpoint_then_resume_is_exact(sft):
    rc, log, _, _ = sft["killed"]
    assert rc != 0 and f"kill_ckpt@{2 * SFT_CKPT}: SIGKILL" in log, log[-3000:]
    # killed after the shards were written, before the marker: the partial checkpoint is not a checkpoint
    assert sft["ckpts"] == [f"step_{SFT_CKPT}", f"step_{2 * SFT_CKPT}.tmp (partial)"], sft["ckpts"]
    assert "removing partial checkpoint" in sft["resumed"] and f"step_{2 * SFT_CKPT}.tmp" in sft["resumed"]
    assert f"continuing at step {SFT_CKPT + 1} of {SFT_STEPS}" in sft["resumed"]
    # steps SFT_CKPT+1 .. 2*SFT_CKPT were lost and redone; the log keeps each step once
    same(rows(sft["out"], "sft_k"), rows(sft["out"], "sft"), SFT_KEYS)
    assert checkpoints(sft["out"], "sft_k") == [f"step_{s}" for s in range(SFT_CKPT, SFT_STEPS + 1, SFT_CKPT)]


@pytest.mark.slow
def test_sft_failed_checkpoint_write_nan_abort_and_nothing_to_resume(tmp_path, tiny_ckpt):
    """One cheap 1-process run: the step-4 checkpoint hits ENOSPC (reported, the run goes on, step_2 stays the
    newest valid one), then steps 5 and 6 are NaN and max_skipped_steps=2 aborts with a message after logging."""
    args = [*SFT, f"--model.path={tiny_ckpt}", "--train.steps=8", "--ckpt.every=2",
            "--train.max_skipped_steps=2", "--train.deterministic=false"]
    rc, log, _, _ = launch("train_sft.py", args, tmp_path, "f", nproc=1, fault="enospc@4,nan@4,nan@5")
    assert rc != 0
    # torch.save reports a full disk cryptically ("unexpected pos 64 vs 0"): the warning adds the free space
    assert re.search(r"WARNING: checkpoint \S+step_4 not saved \(rank 0: RuntimeError: .* MiB free on that disk\)", log), \
        log[-3000:]
    assert "2 consecutive steps (up to step 6) had a non-finite loss or grad norm, train.max_skipped_steps=2: " \
           "aborting. Last batch: sft/loss=nan" in log, log[-3000:]
    rs = train_rows(tmp_path, "f")
    assert [r["step"] for r in rs] == [1, 2, 3, 4, 5, 6]  # the step that tipped it over is logged
    assert [r["ckpt/failed_saves"] for r in rs] == [0, 0, 0, 1, 1, 1]
    assert checkpoints(tmp_path, "f") == ["step_2"]  # nothing partial left; no checkpoint of the aborted step
    assert checkpoint.latest_checkpoint(tmp_path / "f" / "ckpt").name == "step_2"
    # resuming a run whose checkpoint already reached train.steps says so instead of silently training 0 steps
    log = ok(launch("train_sft.py", [*args, "--train.steps=2", "--ckpt.resume=auto"], tmp_path, "f", nproc=1))
    assert "is at step 2 and train.steps=2: nothing to train" in log


# ---------------------------------------------------------------------------------------------------------------
# GRPO: 1 trainer + 1 vLLM rank from the SFT export. Oracle run; then kill the generator rank mid-generation,
# resume and kill the trainer mid-optimizer-step, resume to the end.
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpo(sft):
    out = sft["out"]
    common = [*GRPO, f"--model.path={out / 'sft' / 'hf'}", "--ckpt.resume=auto"]
    res = {"ref": ok(launch("train_grpo.py", common, out, "rl", fault="nan@2"))}
    res["kill_gen"] = launch("train_grpo.py", common, out, "rl_k", fault="nan@2,kill_gen@3")
    res["ckpts_gen"] = checkpoints(out, "rl_k")
    res["prompts_gen"] = rows(out, "rl_k", "prompts.jsonl")
    res["kill_opt"] = launch("train_grpo.py", common, out, "rl_k", fault="nan@2,kill_opt@4")
    res["ckpts_opt"] = checkpoints(out, "rl_k")
    (out / "rl_k" / "ckpt" / "step_6.tmp").mkdir()  # a partial checkpoint, as a kill mid-write leaves: ignored
    res["resumed"] = ok(launch("train_grpo.py", common, out, "rl_k", fault="nan@2"))
    res["out"] = out
    return res


@pytest.mark.slow
def test_grpo_dedicated_generator_rank_logs_every_metric(grpo):
    """The uninterrupted run, 1 trainer + 1 vLLM rank: what each step logs, the thread budget, the outputs."""
    out = grpo["out"]
    # the thread budget (machine.set_threads): the ranks' shares never add up past the cores, and they are disjoint
    # (the vLLM rank's engine binds its OpenMP threads to its share, VLLM_CPU_OMP_THREADS_BIND: tests/test_machine.py)
    cores = len(os.sched_getaffinity(0))
    shares = {int(r): json.loads(c) for r, c in
              re.findall(r"threads: rank (\d) takes \d+ of \d+ cores \(cpus (\[[\d, ]*\])", grpo["ref"])}
    assert sorted(shares) == [0, 1] and sum(map(len, shares.values())) <= max(cores, 2), shares  # 1 core: 1 each
    assert cores < 2 or not set(shares[0]) & set(shares[1]), shares
    all_rows, ref = rows(out, "rl"), train_rows(out, "rl")
    for r in ref:
        for k in LOGGED:  # step 3's loss is made NaN (nan@2), after the loss terms are logged: its gradient is NaN
            assert k in r and (math.isfinite(r[k]) or r["step"] == 3 and k == "train/grad_norm"), (r["step"], k, r.get(k))
        assert r["mismatch/abs_diff"] < 1e-3  # vLLM and the trainer compute the same logprobs
    assert "eval/pass@1" in all_rows[0] and "eval/pass@1" in ref[-1]
    assert (out / "rl" / "hf" / "config.json").exists() and (out / "rl" / "curves.png").exists()
    cfg = json.loads((out / "rl" / "config.json").read_text())
    assert cfg["train"]["steps"] == GRPO_STEPS and cfg["dist"]["generator_ranks"] == 1


@pytest.mark.slow
def test_grpo_sigkill_generator_and_trainer_then_resume_reproduces_the_run(grpo):
    out = grpo["out"]
    ref = train_rows(out, "rl")
    assert [r["step"] for r in ref] == list(range(1, GRPO_STEPS + 1))
    assert all(r["train/grad_norm"] > 0 for r in ref if r["step"] != 3)  # a real learning signal
    assert math.isnan(ref[2]["loss/total"]) and [r["train/skipped_steps"] for r in ref] == [0, 0, 1, 1, 1, 1]
    # kill 1: the generator rank, as it starts generating step 4; the step-2 checkpoint is the newest
    rc, log, _, _ = grpo["kill_gen"]
    assert rc != 0 and "kill_gen@3: SIGKILL rank 1" in log, log[-3000:]
    assert grpo["ckpts_gen"] == ["step_2"] and [r["step"] for r in grpo["prompts_gen"]] == [1, 2, 3]
    # kill 2: the trainer rank, with gradients computed but before the optimizer step of step 5
    rc, log, _, _ = grpo["kill_opt"]
    assert rc != 0 and "kill_opt@4: SIGKILL rank 0" in log, log[-3000:]
    assert "continuing at step 3 of 6" in log
    assert grpo["ckpts_opt"] == ["step_2", "step_4"]
    assert "continuing at step 5 of 6" in grpo["resumed"]
    assert "removing partial checkpoint" in grpo["resumed"] and "step_6.tmp" in grpo["resumed"]
    assert checkpoints(out, "rl_k") == ["step_2", "step_4", "step_6"]
    # the resumed run is the uninterrupted one: same metrics (the restored weights reached the generator before
    # it generated: staleness 0 and equal rewards/lengths), the same skipped step, the same prompts, each once
    same(rows(out, "rl_k"), rows(out, "rl"), GRPO_KEYS, rel=1e-6)
    prompts = rows(out, "rl_k", "prompts.jsonl")
    assert prompts == rows(out, "rl", "prompts.jsonl") and [r["step"] for r in prompts] == list(range(1, 7))
    ids = [i for r in prompts for i in r["ids"]]
    assert len(ids) == len(set(ids)) == 8 * GRPO_STEPS  # no prompt repeated or skipped within the epoch
    assert all(r["rollout/staleness"] == 0 for r in train_rows(out, "rl_k"))
    assert (out / "rl_k" / "hf" / "config.json").exists()


@pytest.mark.slow
def test_dead_rank_is_detected_promptly_and_named(grpo):
    """The killed generator rank: torchrun's agent stops the survivor and names the lost rank, far within the
    collective timeout (60 s here), so nothing hangs."""
    rc, log, _, end = grpo["kill_gen"]
    assert "rank      : 1 (local_rank: 1)" in log and "exitcode  : -9" in log, log[-3000:]
    detect_s = end - sigkill_time(log)
    print(f"dead generator rank: run over {detect_s:.1f} s after the SIGKILL")
    assert detect_s < 30, detect_s


# ---------------------------------------------------------------------------------------------------------------
# Config and data: fast, no subprocess
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,message", [
    ("--rollout.top_p=0", "rollout.top_p=0.0 must be in (0, 1]"),
    ("--rollout.overlong_cache=40", "rollout.overlong_cache=40 must be >= 0 and < rollout.max_tokens"),
    ("--optim.betas=(0.9, 1.0)", "optim.betas=(0.9, 1.0) must be two values in [0, 1)"),
    ("--optim.grad_clip=0", "optim.grad_clip=0.0 must be > 0"),
    ("--dist.tp=0", "dist.tp=0 must be >= 1"),
    ("--dist.timeout_s=-1", "dist.timeout_s=-1.0 must be > 0"),
    ("--train.max_skipped_steps=0", "train.max_skipped_steps=0 must be >= 1"),
    ("--data.long_prompts=cut", "data.long_prompts='cut' must be drop or truncate"),
    ("--data.min_digits=3", "data.min_digits=3 must be >= 1 and <= data.max_digits"),
    ("--model.dtype=fp16", "model.dtype='fp16' must be float32, bfloat16 or auto"),
    ("--ckpt.resume=out/x/ckpt/step_3", "ckpt.resume='out/x/ckpt/step_3' is not a complete checkpoint"),
    ("--rollout.group_size=x", "rollout.group_size: cannot parse 'x' as int"),
    ("--rollout.grup_size=4", "did you mean 'rollout.group_size'"),
])
def test_grpo_config_errors_name_the_field(override, message, tiny_ckpt):
    with pytest.raises(config.ConfigError) as e:
        cfg = train_grpo.parse_config([str(ROOT / "configs/tiny.py"), f"--model.path={tiny_ckpt}", override])
        checks.grpo(cfg, 2)
    assert message in str(e.value)


def test_sft_config_errors_name_the_field(tiny_ckpt, tmp_path):
    cfg = train_sft.parse_config([str(ROOT / "configs/sft_tiny.py"), f"--ckpt.resume={tmp_path}/step_2"])
    (tmp_path / "step_2").mkdir()  # exists, but no COMPLETE marker: a partial checkpoint
    with pytest.raises(config.ConfigError, match="is not a complete checkpoint"):
        checks.sft(cfg, 1)
    with pytest.raises(config.ConfigError, match=r"train.max_skipped_steps=0 must be >= 1"):
        checks.sft(train_sft.parse_config([str(ROOT / "configs/sft_tiny.py"), "--train.max_skipped_steps=0"]), 1)


def test_grpo_data_malformed_rows_and_long_prompts(tiny_ckpt, tmp_path, capsys):
    good = [json.loads(line) for line in open(GSM8K_DIR / "train.jsonl")][:40]
    bad = [{"question": "", "answer": "#### 3"}, {"question": "q?", "answer": "no marker"},
           {"question": "q?", "answer": "#### three"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good + bad) + "{not json\n")
    tok = data.Tokenizer(tiny_ckpt)
    base = [str(ROOT / "configs/tiny.py"), f"--model.path={tiny_ckpt}", "--data.name=gsm8k", f"--data.source={tmp_path / 'train.jsonl'}",
            f"--data.eval_source={tmp_path / 'train.jsonl'}", "--eval.num_problems=5", "--data.max_bad_fraction=0.1"]
    lens = [len(data.prompt_ids(tok, r["question"])) for r in good]
    limit = sorted(lens)[len(lens) // 2]  # about half the prompts are longer
    train, _, num_long = rollout.load_tasks(train_grpo.parse_config([*base, f"--data.max_prompt_tokens={limit}"]), tok)
    assert "skipped 4/44 malformed rows" in capsys.readouterr().err
    assert num_long == sum(n > limit for n in lens) + sum(n > limit for n in lens[:5])  # train + held-out, counted
    assert len(train) == sum(n <= limit for n in lens) and [p["id"] for p in train] == list(range(len(train)))
    cfg = train_grpo.parse_config([*base, f"--data.max_prompt_tokens={limit}", "--data.long_prompts=truncate"])
    train, _, _ = rollout.load_tasks(cfg, tok)
    assert len(train) == len(good) and max(len(p["prompt_ids"]) for p in train) == limit
    long = next(p for p in train if len(data.prompt_ids(tok, p["question"])) > limit)
    assert long["prompt_ids"] == data.prompt_ids(tok, long["question"])[-limit:]  # the generation prompt survives
    with pytest.raises(ValueError, match="more than max_bad_fraction=0.05"):
        rollout.load_tasks(train_grpo.parse_config([*base, "--data.max_bad_fraction=0.05"]), tok)


@pytest.mark.slow
def test_dead_node_does_not_hang_the_other(sft, tmp_path):
    """Two torchrun agents (--nnodes=2, one process each), as on two machines: node 1's worker (the generator
    rank) is SIGKILLed as it starts generating step 2. Node 0 must not wait for it beyond dist.timeout_s."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout_s = 20
    args = [*GRPO, f"--model.path={sft['out'] / 'sft' / 'hf'}", "--train.steps=3",
            "--ckpt.every=0", f"--dist.timeout_s={timeout_s}", f"--log.out_dir={tmp_path}", "--log.run=mn"]
    env = {**{k: v for k, v in os.environ.items() if k != "NANOFORGE_FAULT"}, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               "train_grpo.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**env, **({"NANOFORGE_FAULT": "kill_gen@1"} if node else {})})
             for node in (0, 1)]
    logs, ends = [], []
    for p in procs:
        logs.append(p.communicate(timeout=300)[0])
        ends.append(time.time())
    assert procs[0].returncode != 0 and procs[1].returncode != 0, logs[0][-2000:] + logs[1][-2000:]
    t_kill = sigkill_time(logs[1])
    print(f"dead node: node 0 exited {ends[0] - t_kill:.1f} s after node 1's worker was SIGKILLed "
          f"(dist.timeout_s={timeout_s}); node 0 said: {logs[0][-1500:]}")
    assert "rank      : 1" in logs[1] and "exitcode  : -9" in logs[1]  # node 1's agent names the lost rank
    assert "rank 0: a collective failed" in logs[0] and "lost rank(s) [1]" in logs[0], logs[0][-3000:]  # so does node 0
    assert ends[0] - t_kill < timeout_s + 15, ends[0] - t_kill
