"""End-to-end GRPO runs, for real: torchrun with a vLLM generator rank, the colocated mode, resume, and
the multi-node rendezvous path, each on the tiny task on CPU (gloo). Runs share one tiny checkpoint."""
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

import data
import tasks
from conftest import GSM8K_DIR, ROOT, export_greedy

pytestmark = pytest.mark.slow
SMALL = ["--dist.generator_ranks=1", "--rollout.backend=vllm", "--rollout.prompts_per_step=8", "--rollout.group_size=4", "--rollout.max_tokens=24",
         "--eval.num_problems=32", "--rollout.kv_cache_mb=32", "--dist.timeout_s=120"]


def run(args, tmp_path, nproc=2, timeout=420, extra_env=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] if nproc else \
        [sys.executable]
    env = {**os.environ, **(extra_env or {})}
    res = subprocess.run([*launcher, "train_grpo.py", "configs/tiny.py", *SMALL, f"--log.out_dir={tmp_path}",
                          *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def metrics(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def start_ckpt(tiny_ckpt):
    return str(tiny_ckpt)


def test_hf_export_loads_in_vllm_and_matches(tmp_path, start_ckpt):
    """Colocated mode (plain python, vLLM in the trainer's process); its export opens in model.py."""
    run([f"--model.path={start_ckpt}", "--train.steps=2", "--dist.generator_ranks=0",
         "--log.run=c"], tmp_path, nproc=0)
    rows = [r for r in metrics(tmp_path / "c" / "metrics.jsonl") if "perf/step_s" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss/entropy"]) for r in rows)
    # vLLM opens the export as-is and its greedy continuation equals the pure-torch generator's on it
    tok = data.Tokenizer(tmp_path / "c" / "hf")
    vllm_ids, torch_ids = export_greedy(tmp_path / "c" / "hf", [data.prompt_ids(tok, p["question"])
                                                                 for p in tasks.make_arith(4, seed=5)], max_tokens=12)
    assert vllm_ids == torch_ids and len(vllm_ids) == 4


def test_multinode_rendezvous_two_agents(tmp_path, start_ckpt):
    """Two torchrun agents (--nnodes=2, one process each) rendezvous on 127.0.0.1 and run 2 steps."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",  # noqa
                        f"--node_rank={node}", f"--master_addr=127.0.0.1", f"--master_port={port}",
                        "train_grpo.py", "configs/tiny.py", *SMALL, f"--log.out_dir={tmp_path}",
                        f"--model.path={start_ckpt}", "--train.steps=2", "--log.run=mn"]
    procs = [subprocess.Popen(cmd(n), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=420)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    rows = [r for r in metrics(tmp_path / "mn" / "metrics.jsonl") if "perf/step_s" in r]
    assert [r["step"] for r in rows] == [1, 2]


def test_bf16_trains_logs_mismatch_and_the_correction_engages(tmp_path, start_ckpt):
    """model.dtype=bfloat16 on CPU, one process, the torch generator colocated (in bf16 too, as on a
    GPU without vLLM): FSDP2 computes in bf16 over fp32 master weights and reduces in fp32. Oracle:
    the same run in fp32, where trainer and generator agree to float rounding. The entropy bonus
    gives a gradient although the random model earns no reward. Truncated IS capped at 1.001
    (log 1e-3) sits inside bf16's mismatch and far outside fp32's."""
    common = [f"--model.path={start_ckpt}", "--train.steps=3", "--dist.generator_ranks=0",
              "--rollout.backend=torch", "--loss.correction=tis", "--loss.correction_c=1.001",
              "--loss.entropy_coef=0.01", "--eval.every=0"]
    rows = {}
    for dtype in ("bfloat16", "float32"):
        run([*common, f"--model.dtype={dtype}", f"--log.run={dtype}"], tmp_path, nproc=0)
        rows[dtype] = [r for r in metrics(tmp_path / dtype / "metrics.jsonl") if "perf/step_s" in r]
        assert [r["step"] for r in rows[dtype]] == [1, 2, 3]
    for b, f in zip(rows["bfloat16"], rows["float32"]):
        print(f"step {b['step']}: mismatch/abs_diff bf16 {b['mismatch/abs_diff']:.2e} "
              f"fp32 {f['mismatch/abs_diff']:.2e}, tis capped bf16 {b['loss/is_capped_frac']:.3f} "
              f"fp32 {f['loss/is_capped_frac']:.3f}")
        assert math.isfinite(b["loss/total"]) and 0 < b["train/grad_norm"] < math.inf
        assert b["train/skipped_steps"] == 0
        # logged, and bf16's is real
        assert 1e-4 < b["mismatch/abs_diff"] < 0.1 and f["mismatch/abs_diff"] < 1e-5
        # the cap engages on bf16's
        assert b["loss/is_capped_frac"] > 0.01 and f["loss/is_capped_frac"] == 0
        assert b["loss/is_weight_mean"] < 1.0


def test_drift_metrics_measure_without_changing_the_run(tmp_path, start_ckpt):
    """log.drift: the same run with and without it agrees on every metric it shares (the extra forwards are no-grad
    and the frozen start copy is outside the loss), KL to the start is exactly 0 before the first update and grows
    after it, and one update at a large lr moves a measurable share of tokens past PPO's clip range."""
    common = [f"--model.path={start_ckpt}", "--train.steps=2", "--dist.generator_ranks=0", "--rollout.backend=torch",
              "--loss.entropy_coef=0.01", "--optim.lr=0.01", "--eval.every=0"]
    rows = {}
    for on in ("true", "false"):
        run([*common, f"--log.drift={on}", f"--log.run=drift_{on}"], tmp_path, nproc=0)
        rows[on] = [r for r in metrics(tmp_path / f"drift_{on}" / "metrics.jsonl") if "perf/step_s" in r]
    for a, b in zip(rows["true"], rows["false"]):
        assert {k: v for k, v in a.items() if not k.startswith(("perf/", "sync/", "drift/"))} == \
               {k: v for k, v in b.items() if not k.startswith(("perf/", "sync/"))}
    first, second = rows["true"]
    assert first["drift/kl_start"] == 0.0 < second["drift/kl_start"]
    assert 0 < first["drift/kl_step"] < math.inf and 0 < first["drift/moved_frac"] <= 1


@pytest.mark.parametrize("tp", [1, 2])
def test_headline_command_at_its_own_size(tmp_path, start_ckpt, tp):
    """`torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k.py` itself, changing only what CPU forces (a tiny
    model, fp32, a small KV cache, few prompts and tokens, 2 steps, the local GSM8K): 6 FSDP2 trainer ranks (3 x 2
    with dist.tp=2), 2 vLLM generator ranks, staleness 1, the reference model (beta 0.04), pass@8 eval. Every rank
    exits 0, the metrics are finite, each generator rank ends at weight version 2, and vLLM opens the export."""
    data_dir = GSM8K_DIR
    cpu = [f"--model.path={start_ckpt}", "--model.dtype=float32", "--rollout.kv_cache_mb=32",
           "--rollout.prompts_per_step=12", "--rollout.group_size=2", "--rollout.max_tokens=16",
           "--eval.num_problems=12", "--train.steps=2", "--train.micro_batch=8", "--dist.timeout_s=300",
           f"--data.source={data_dir}/train.jsonl", f"--data.eval_source={data_dir}/test.jsonl",
           f"--dist.tp={tp}", f"--log.out_dir={tmp_path}", "--log.run=gsm8k", "--ckpt.every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=8", "train_grpo.py",
                          "configs/gsm8k.py", *cpu], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    cfg = json.loads((tmp_path / "gsm8k" / "config.json").read_text())
    assert (cfg["dist"]["generator_ranks"], cfg["rollout"]["max_staleness"], cfg["loss"]["kwargs"]["beta"],
            cfg["eval"]["pass_k"], cfg["data"]["name"]) == (2, 1, 0.04, 8, "gsm8k")  # the recipe's own settings
    rows = metrics(tmp_path / "gsm8k" / "metrics.jsonl")
    train_rows = [r for r in rows if "perf/step_s" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and "eval/pass@8" in rows[-1]
    for r in train_rows:
        for k in ("loss/pg", "loss/kl", "loss/entropy", "train/grad_norm", "mismatch/abs_diff", "rollout/reward_mean"):
            assert math.isfinite(r[k]), (k, r[k])
        assert r["perf/ref_s"] > 0  # the reference model ran
    assert [r["rollout/staleness"] for r in train_rows] == [0.0, 1.0]
    # ranks share one stdout pipe, so another rank's output can land inside a line: match the phrase, not lines
    done = sorted(re.findall(r"generator rank (\d+): done, weight version (\d+) after (\d+) steps", res.stdout))
    assert done == [("6", "2", "2"), ("7", "2", "2")], res.stdout[-3000:]
    vllm_ids, _ = export_greedy(tmp_path / "gsm8k" / "hf", [[1, 2, 3]], max_tokens=4, max_model_len=128)
    assert len(vllm_ids[0]) == 4  # vLLM opens the export


def test_bench_gpu_cpu_smoke():
    """bench/gpu.sh --cpu-smoke: the GPU check's code paths (a GRPO run through train_grpo.main,
    the MFU, logprob-memory and generator probes, parity against transformers, the update on a
    repeated and on fresh batches, a LoRA run) at toy sizes on CPU, so the script is known to run
    before a GPU sees it. A part or an update variant that raised makes the script exit non-zero."""
    res = subprocess.run(["bash", "bench/gpu.sh", "--cpu-smoke"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for row in ("GRPO step: gen / ref / train / sync / other", "GRPO generation", "GRPO update TFLOP/s, MFU; ref",
                "GRPO, one gsm8k.py trainer rank step: gen / ref / train / sync / other",
                "parity vs transformers, 2 x 16", "trainer step (FSDP2, bf16)", "logprob peak, T=64 fwd+bwd",
                "torch generator", "update, eager_16 ", "update, nocudnn_16_fresh ",
                "GRPO, LoRA r32 step: gen / ref / train / sync / other", "GRPO, LoRA r32 sync"):
        assert f"| {row}" in res.stdout, (row, res.stdout[-2000:])
    assert "FAILED" not in res.stdout, res.stdout[-2000:]


# A reward under which ~3 of 4 groups are unanimous: only prompts whose answer is divisible by 4 can score, and
# among those the score is the parity of the response's length, which a random model varies within a group.
SPARSE_REWARD = '''
class Sparse:
    def __call__(self, prompt, response, target):
        return float(len(response) % 2) if int(target) % 4 == 0 else 0.0
'''
REFILL = ["--rollout.prompts_per_step=8", "--rollout.group_size=4", "--rollout.filter_zero_std=true",
          "--rollout.refill_rounds=12", "--loss.name=dapo", "--loss.kwargs={}", "--eval.every=0"]


def check_refilled(run_dir, cfg_args):
    """Every trained batch holds B informative groups: the logged prompts all have answers divisible by 4 (the
    only groups that can have 0 < std), the trained rewards have no zero-std group, and refills happened."""
    import data
    import rollout
    import train_grpo
    cfg = train_grpo.parse_config(["configs/tiny.py", *SMALL, *cfg_args])
    train, _, _ = rollout.load_tasks(cfg, data.Tokenizer(cfg.model.path))
    rows = [r for r in metrics(run_dir / "metrics.jsonl") if "perf/step_s" in r]
    prompts = metrics(run_dir / "prompts.jsonl")
    assert [p["step"] for p in prompts] == [r["step"] for r in rows]
    for r, p in zip(rows, prompts):
        assert len(p["ids"]) == 8 and all(int(train[i]["target"]) % 4 == 0 for i in p["ids"]), p
        assert r["rollout/zero_std_frac"] == 0 and r["rollout/informative_groups"] == 8
        assert r["rollout/prompts_drawn"] == 8 * (r["rollout/refill_rounds"] + 1)
    assert sum(r["rollout/refill_rounds"] for r in rows) >= len(rows)  # about 3 rounds a step at this sparsity
    return rows, prompts


def test_dynamic_sampling_refills_to_b_informative_groups_and_resumes(tmp_path, start_ckpt, monkeypatch):
    """DAPO dynamic sampling, colocated, one process: every trained batch is refilled to B informative groups; a
    resume from step 2 redraws the same rounds (same prompts, same metrics)."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "sparse.py").write_text(SPARSE_REWARD)
    common = [f"--model.path={start_ckpt}", "--dist.generator_ranks=0", "--rollout.backend=torch", *REFILL,
              f"--rollout.rewards={{'{tmp_path}/sparse.py:Sparse': 1.0}}", "--train.steps=4", "--ckpt.every=2",
              "--optim.lr=0.01"]
    run([*common, "--log.run=a"], tmp_path, nproc=0)
    rows, prompts = check_refilled(tmp_path / "a", common)
    shutil.copytree(tmp_path / "a" / "ckpt" / "step_2", tmp_path / "b" / "ckpt" / "step_2")
    run([*common, "--log.run=b", "--ckpt.resume=auto"], tmp_path, nproc=0)
    resumed, resumed_prompts = check_refilled(tmp_path / "b", common)
    assert resumed_prompts == prompts[2:]
    for a, b in zip(rows[2:], resumed):
        for k in ("rollout/refill_rounds", "rollout/reward_mean", "rollout/response_len", "loss/pg"):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k


def test_colocated_staleness_two_trains_on_samples_two_versions_old(tmp_path, start_ckpt):
    """Colocated with max_staleness=2: batch s+2 is sampled before the update on batch s, so
    staleness climbs 0, 1, 2 and holds, and the trainer's policy differs from the sampler's. A
    loss.correction sees that gap: truncated IS at C = 1.001 caps nothing on step 1 (one version,
    fp32) and caps tokens from step 2 on. (It used to compare the sampler with itself when stale,
    and weigh every token 1.) Its pi_old is the trainer's own policy, so the PPO ratio is 1 and
    nothing is clipped."""
    run([f"--model.path={start_ckpt}", "--dist.generator_ranks=0", "--rollout.backend=torch",
         "--train.steps=4", "--rollout.max_staleness=2", "--loss.entropy_coef=0.01",
         "--optim.lr=0.01", "--eval.every=0", "--loss.correction=tis", "--loss.correction_c=1.001",
         "--log.run=c"], tmp_path, nproc=0)
    rows = [r for r in metrics(tmp_path / "c" / "metrics.jsonl") if "perf/step_s" in r]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    # the policy moved in between
    assert rows[0]["mismatch/abs_diff"] < 1e-5 < rows[1]["mismatch/abs_diff"]
    assert rows[0]["loss/is_capped_frac"] == 0
    assert rows[0]["loss/is_weight_mean"] == pytest.approx(1, abs=1e-4)
    assert all(r["loss/is_capped_frac"] > 0.01 and r["loss/clip_frac"] == 0 for r in rows[1:])


def test_staleness_two_killed_between_steps_resumes_deterministically(tmp_path, start_ckpt):
    """What was generated ahead is not checkpointed: a run killed in step 4 (generating step 6's
    batch ahead) resumes from its step-2 checkpoint and regenerates batches 3..5 with the restored
    weights. Oracles: the uninterrupted run's data order (the same prompts, each once); staleness
    climbing again from 0 after the resume; and a second resume from a copy of the same checkpoint
    computing the same numbers."""
    args = [f"--model.path={start_ckpt}", "--dist.generator_ranks=0", "--rollout.backend=torch",
            "--train.steps=6", "--rollout.max_staleness=2", "--loss.entropy_coef=0.01",
            "--optim.lr=0.01", "--eval.every=0", "--ckpt.every=2", "--ckpt.resume=auto"]
    run([*args, "--log.run=a"], tmp_path, nproc=0)
    killed = subprocess.run([sys.executable, "train_grpo.py", "configs/tiny.py", *SMALL, *args,
                             f"--log.out_dir={tmp_path}", "--log.run=b"], cwd=ROOT, text=True,
                            capture_output=True, timeout=420,
                            env={**os.environ, "NANOFORGE_FAULT": "kill_gen@5"})
    assert killed.returncode != 0 and "kill_gen@5: SIGKILL" in killed.stderr, killed.stderr[-2000:]
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    for name in ("b", "c"):
        run([*args, f"--log.run={name}"], tmp_path, nproc=0)
    a, b, c = ([r for r in metrics(tmp_path / n / "metrics.jsonl") if "perf/step_s" in r]
               for n in "abc")
    assert [r["rollout/staleness"] for r in a] == [0, 1, 2, 2, 2, 2]
    resumed = [r for r in b if r["step"] >= 3][-4:]  # the resumed steps, after the killed run's
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert [r["rollout/staleness"] for r in resumed] == [0, 1, 2, 2]
    keys = ("rollout/reward_mean", "rollout/response_len", "loss/total", "train/grad_norm")
    for x, y in zip(resumed, [r for r in c if r["step"] >= 3][-4:]):
        assert all(x[k] == y[k] for k in keys), (x, y)
    prompts = [json.loads(line) for line in open(tmp_path / "a" / "prompts.jsonl")]
    assert [json.loads(line) for line in open(tmp_path / "b" / "prompts.jsonl")][-4:] == prompts[2:]


@pytest.mark.parametrize("backend", ["torch", "vllm"])
def test_inflight_updates_land_mid_sequence_and_each_token_keeps_its_version(tmp_path, start_ckpt,
                                                                            backend):
    """1 trainer + 1 generator rank at max_staleness=2 with in-flight updates: the sync after step s
    reaches the generator while it samples batch s+2 (the inflight_at@3 hook makes it land exactly
    after each row's third token, so the run is deterministic; without it, wherever the update
    ends).
    Oracles, from the schedule: rows keep the version of their first token (staleness 0 1 1 2 2)
    while their tokens are fresher, and exactly the batches generated across a sync are mixed:
    batches 2, 4 and 5 (3 was generated after step 1's sync had landed in batch 2). The vLLM rank
    plays calculator episodes, so the poll also runs through episodes.MultiTurn."""
    args = [f"--model.path={start_ckpt}", f"--rollout.backend={backend}", "--train.steps=5",
            "--rollout.max_staleness=2", "--rollout.inflight_updates=true", "--eval.every=0",
            "--loss.entropy_coef=0.01", "--optim.lr=0.01", "--log.run=f"]
    if backend == "vllm":
        args += ["--rollout.env=calculator", "--rollout.overlong_cache=0"]
    run(args, tmp_path, extra_env={"NANOFORGE_FAULT": "inflight_at@3"})
    rows = [r for r in metrics(tmp_path / "f" / "metrics.jsonl") if "perf/step_s" in r]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 2, 2]
    mixed = [r["rollout/inflight_frac"] for r in rows]
    assert mixed[0] == mixed[2] == 0 and min(mixed[1], mixed[3], mixed[4]) > 0.5, mixed
    token = [r["rollout/token_staleness"] for r in rows]
    assert token[0] == 0 and token[2] == 1, token
    for i in (1, 3, 4):  # 3 of ~24 tokens at the older version
        stale = rows[i]["rollout/staleness"]
        assert stale - 1 < token[i] < stale - 0.5, token
    assert all(math.isfinite(r["loss/total"]) for r in rows)


def test_mismatch_and_drift_measure_the_policy_before_the_update_with_four_minibatches(
        tmp_path, start_ckpt):
    """train.minibatches=4 takes four optimizer steps a batch. Mismatch compares the sampler with
    the policy before the first of them (on-policy: the same weights, so ~0), not with minibatches
    scored after earlier steps; drift sees the whole update. At this lr, scoring after earlier steps
    would read a mismatch of ~drift's size."""
    run([f"--model.path={start_ckpt}", "--dist.generator_ranks=0", "--rollout.backend=torch",
         "--train.steps=2", "--train.minibatches=4", "--optim.lr=0.01", "--log.drift=true",
         "--eval.every=0", "--log.run=m"],
        tmp_path, nproc=0)
    rows = [r for r in metrics(tmp_path / "m" / "metrics.jsonl") if "perf/step_s" in r]
    for r in rows:
        assert r["mismatch/abs_diff"] < 1e-5, r["mismatch/abs_diff"]
        assert r["drift/kl_step"] > 1e-4, r["drift/kl_step"]  # the four steps did move the policy


def test_dynamic_sampling_refills_with_a_dedicated_generator_rank(tmp_path, start_ckpt, monkeypatch):
    """The same with 1 trainer + 1 vLLM rank, generating one batch ahead: the trainer scores each
    round and one all_gather tells the generator rank which groups count, so it knows whether
    another round follows."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "sparse.py").write_text(SPARSE_REWARD)
    common = [f"--model.path={start_ckpt}", *REFILL, f"--rollout.rewards={{'{tmp_path}/sparse.py:Sparse': 1.0}}",
              "--rollout.max_staleness=1", "--train.steps=3", "--log.run=d"]
    run(common, tmp_path)
    check_refilled(tmp_path / "d", common)


COUNTED_REWARD = SPARSE_REWARD + '''
class Counted(Sparse):  # one line per call, from every rank
    def __call__(self, prompt, response, target):
        with open(__file__ + ".calls", "a") as f:
            f.write("1\\n")
        return super().__call__(prompt, response, target)
'''


def test_dynamic_sampling_with_two_data_parallel_trainers_scores_every_group_once(
        tmp_path, start_ckpt, monkeypatch):
    """Two colocated trainers: each scores its half of every round, one all_gather gives both all
    the rewards, so they agree on the refill and train on the scores already made: reward calls =
    groups drawn x G, no more."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "counted.py").write_text(COUNTED_REWARD)
    common = [f"--model.path={start_ckpt}", "--dist.generator_ranks=0", "--rollout.backend=torch",
              *REFILL, f"--rollout.rewards={{'{tmp_path}/counted.py:Counted': 1.0}}",
              "--train.steps=2", "--log.run=e"]
    run(common, tmp_path)
    rows, _ = check_refilled(tmp_path / "e", common)
    calls = len((tmp_path / "counted.py.calls").read_text().split())
    assert calls == sum(r["rollout/prompts_drawn"] for r in rows) * 4  # G = 4
