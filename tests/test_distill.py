"""On-policy distillation (distill.teacher; docs/distill.md): the teacher's per-token logprobs as
the advantage, checked against the exact reverse KL over the vocabulary, and end to end through the
trainer: teacher = student gives nothing to learn, a vLLM rank under torchrun, multi-turn episodes,
exact resume, and the config errors. The per-token formula against a slow loop and the zero
gradient of every loss are tests/test_losses.py's (E10)."""
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

import data
import generator
import losses
import packing
import tasks
from conftest import ROOT
from model import Transformer


def test_the_sampled_advantage_estimates_the_exact_reverse_kl(tmp_path):
    """-sum_t A_t / coef per sequence is an unbiased estimate of KL(student || teacher) over
    sequences. Its expectation equals that of the exact per-position KLs summed along the same
    sampled prefixes (over the whole vocabulary): their mean difference over 128 samples is within
    4 standard errors of 0, while the KL itself is far from 0."""
    student_dir = data.make_tiny_checkpoint(tmp_path / "s", seed=0)
    teacher = Transformer.from_pretrained(data.make_tiny_checkpoint(tmp_path / "t", seed=1))
    with torch.no_grad():  # a sharper teacher than a random init: ~48 nats a sequence here
        teacher.model.norm.weight.mul_(5.0)
    student = Transformer.from_pretrained(student_dir)
    tok = data.Tokenizer(student_dir)
    problems = [{"prompt_ids": data.prompt_ids(tok, p["question"])}
                for p in tasks.make_arith(4, seed=3)]
    gen = generator.TorchGenerator(str(student_dir), max_model_len=128)
    groups = gen.generate([p["prompt_ids"] for p in problems], n=32, temperature=1.0,
                          max_tokens=12, seed=7)
    batch = packing.make_batch(problems, groups, tok.pad_token_id)
    batch["teacher_logp"] = packing.no_grad_logp(teacher, batch, 64, 1.0)
    adv = losses.distill_advantages(batch["teacher_logp"], batch["gen_logp"], batch["mask"], 2.0)
    sampled = -adv.sum(1).double() / 2.0
    P, R = batch["P"], batch["mask"].shape[1]
    with torch.no_grad():  # the exact KL at every response position, over the whole vocabulary
        ls, lt = (torch.log_softmax(m(batch["ids"], attention_mask=batch["attn"]).double(), -1)
                  [:, P - 1:P - 1 + R] for m in (student, teacher))
    exact = ((ls.exp() * (ls - lt)).sum(-1) * batch["mask"]).sum(1)
    diff = sampled - exact
    se = float(diff.std() / math.sqrt(len(diff)))
    assert abs(float(diff.mean())) <= 4 * se, (float(diff.mean()), se)
    assert float(exact.mean()) > 20 * se and float(exact.mean()) > 1.0, float(exact.mean())


@pytest.mark.slow
def test_the_policy_gradient_follows_the_exact_reverse_kl_gradient(tmp_path):
    """What the update does with these advantages: the GRPO loss's gradient (on-policy, token mean)
    points along the exact gradient of the per-position reverse KL (over the whole vocabulary, on
    the same sampled prefixes), the objective distillation descends: cosine > 0.8 over 256 samples
    (0.888 measured on both CPU numeric paths). The teacher is the student sharpened (its final
    norm x 3): it prefers what the student prefers, more strongly."""
    student_dir = data.make_tiny_checkpoint(tmp_path / "s", seed=0)
    student, teacher = (Transformer.from_pretrained(student_dir) for _ in range(2))
    with torch.no_grad():
        teacher.model.norm.weight.mul_(3.0)
    tok = data.Tokenizer(student_dir)
    problems = [{"prompt_ids": data.prompt_ids(tok, p["question"])}
                for p in tasks.make_arith(32, seed=3)]
    groups = generator.TorchGenerator(str(student_dir), max_model_len=128).generate(
        [p["prompt_ids"] for p in problems], n=8, temperature=1.0, max_tokens=24, seed=7)
    batch = packing.make_batch(problems, groups, tok.pad_token_id)
    mask, P, R = batch["mask"], batch["P"], batch["mask"].shape[1]
    batch["teacher_logp"] = packing.no_grad_logp(teacher, batch, 64, 1.0)
    adv = losses.distill_advantages(batch["teacher_logp"], batch["gen_logp"], mask)
    logp = packing.response_logp(student, batch, slice(None), 1.0)
    loss, _ = losses.GRPOLoss(beta=0.0, agg="token_mean")(logp, None, adv, mask)
    sampled = torch.autograd.grad(loss, list(student.parameters()))
    with torch.no_grad():
        lt = torch.log_softmax(teacher(batch["ids"], attention_mask=batch["attn"]), -1)
    ls = torch.log_softmax(student(batch["ids"], attention_mask=batch["attn"]), -1)
    at = slice(P - 1, P - 1 + R)
    kl = ((ls[:, at].exp() * (ls[:, at] - lt[:, at])).sum(-1) * mask).sum() / mask.sum()
    exact = torch.autograd.grad(kl, list(student.parameters()))
    a, b = torch.cat([g.flatten() for g in sampled]), torch.cat([g.flatten() for g in exact])
    assert float(a @ b / a.norm() / b.norm()) > 0.8


def run(args, tmp_path, nproc=0, timeout=420):
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
                if nproc else [sys.executable])
    res = subprocess.run([*launcher, "train_grpo.py", "configs/tiny.py",
                          "--rollout.prompts_per_step=8", "--rollout.group_size=2",
                          "--rollout.max_tokens=24", "--eval.every=0", "--eval.num_problems=16",
                          "--dist.timeout_s=120", f"--log.out_dir={tmp_path}", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return res


def rows(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")
            if "perf/step_s" in json.loads(line)]


COLOCATED = ["--dist.generator_ranks=0", "--rollout.backend=torch", "--optim.lr=0.01",
             "--optim.warmup_steps=0"]


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_teaches_nothing_and_another_one_does(tmp_path, tiny_ckpt):
    """Teacher = student: at step 1 the per-token reverse KL is 0 within the generator's mismatch
    (fp32), and so is the gradient (not Adam's first step, a sign step: docs/distill.md). Another
    teacher, one sample per prompt: on-policy, GRPO's token-mean loss value is -mean_t A_t, the
    logged reverse KL itself."""
    same = run([f"--model.path={tiny_ckpt}", f"--distill.teacher={tiny_ckpt}", *COLOCATED,
                "--train.steps=1", "--log.run=same"], tmp_path)
    assert same.returncode == 0, same.stderr[-4000:]
    (r,) = rows(tmp_path / "same")
    assert abs(r["distill/reverse_kl"]) < 1e-5 and r["train/grad_norm"] < 1e-4, r
    other = run([f"--model.path={tiny_ckpt}", f"--distill.teacher=tiny:{tmp_path}/teacher@1",
                 *COLOCATED, "--rollout.group_size=1", "--train.steps=2", "--log.run=other"],
                tmp_path)
    assert other.returncode == 0, other.stderr[-4000:]
    for r in rows(tmp_path / "other"):
        assert r["distill/reverse_kl"] > 1e-3 and r["perf/teacher_s"] > 0, r
        assert r["loss/pg"] == pytest.approx(r["distill/reverse_kl"], rel=1e-5), r


@pytest.mark.slow
def test_distillation_with_a_vllm_rank_under_torchrun_and_exact_resume(tmp_path, tiny_ckpt):
    """1 trainer + 1 vLLM rank: the sampler's logprobs are vLLM's, the mismatch stays as in the
    single-turn path, and a run resumed at step 2 repeats steps 3-4 exactly."""
    common = [f"--model.path={tiny_ckpt}", f"--distill.teacher=tiny:{tmp_path}/teacher@1",
              "--dist.generator_ranks=1", "--rollout.backend=vllm", "--rollout.kv_cache_mb=32",
              "--train.steps=4", "--ckpt.every=2", "--optim.lr=0.01", "--optim.warmup_steps=0"]
    a = run([*common, "--log.run=a"], tmp_path, nproc=2)
    assert a.returncode == 0, a.stderr[-4000:]
    ra = rows(tmp_path / "a")
    assert all(math.isfinite(r["loss/total"]) and r["mismatch/abs_diff"] < 1e-5 for r in ra), ra
    assert all(r["distill/reverse_kl"] > 1e-3 for r in ra)
    shutil.copytree(tmp_path / "a" / "ckpt" / "step_2", tmp_path / "b" / "ckpt" / "step_2")
    b = run([*common, "--log.run=b", "--ckpt.resume=auto"], tmp_path, nproc=2)
    assert b.returncode == 0, b.stderr[-4000:]
    for x, y in zip(ra[2:], rows(tmp_path / "b"), strict=True):
        for k in ("distill/reverse_kl", "loss/total", "train/grad_norm"):
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9), k


@pytest.mark.slow
def test_in_multi_turn_episodes_the_teacher_scores_the_trained_tokens_only(tmp_path, tiny_ckpt):
    """Retry episodes (a wrong answer gets a hint and another turn) on two colocated trainers under
    torchrun, the teacher sharded by FSDP2 like the policy: the hint's tokens sit inside the
    response with mask 0 and no sampler logprob. With teacher = student the KL on the trained
    tokens is ~0; had the hint's tokens counted, the teacher's logprobs there (~ -6 nats) would
    show."""
    res = run([f"--model.path={tiny_ckpt}", f"--distill.teacher={tiny_ckpt}", *COLOCATED,
               "--rollout.env=retry", "--rollout.max_turns=2", "--train.steps=1",
               "--log.run=mt"], tmp_path, nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    (r,) = rows(tmp_path / "mt")
    assert abs(r["distill/reverse_kl"]) < 1e-5 and r["episode/turns"] > 1, r


def test_config_errors_name_the_field(tmp_path, tiny_ckpt, monkeypatch):
    """A teacher with another vocabulary, a missing teacher, and the group-size rule: one sample per
    prompt is enough for pure distillation, not once the task reward's group advantage is mixed
    in."""
    import checks
    import config
    import train_grpo
    monkeypatch.chdir(ROOT)
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(config.ConfigError, match=r"distill.teacher .* another tokenizer.*2 of"):
        checks.same_vocab(str(tiny_ckpt), str(other))
    checks.same_vocab(str(tiny_ckpt), str(tiny_ckpt))

    def cfg(*args):
        return train_grpo.parse_config(["configs/tiny.py", f"--model.path={tiny_ckpt}", *args])
    checks.grpo(cfg(f"--distill.teacher={tiny_ckpt}", "--rollout.group_size=1"), 1)
    with pytest.raises(config.ConfigError, match="group_size=1: group advantages"):
        checks.grpo(cfg(f"--distill.teacher={tiny_ckpt}", "--rollout.group_size=1",
                        "--distill.reward_weight=0.5"), 1)
    with pytest.raises(config.ConfigError, match=r"distill.teacher: no config.json in"):
        checks.grpo(cfg(f"--distill.teacher={tmp_path}/nowhere"), 1)
    with pytest.raises(config.ConfigError, match=r"distill.coef=0.0 must be > 0"):
        checks.grpo(cfg(f"--distill.teacher={tiny_ckpt}", "--distill.coef=0"), 1)


def test_the_distillation_demo_reports_where_each_side_first_reaches_the_teacher(tmp_path):
    """scripts/demo_distill.py's figures from two runs' metrics: training seconds are the sum of
    perf/step_s less the evals' perf/eval_s, and "reached" is the first eval at or above 90% of
    the teacher, or None when a run never gets there. Bad arguments exit before any run starts."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import demo_distill
    rows = [{"step": 0, "eval/pass@1": 0.3}, {"step": 1, "perf/step_s": 10.0},
            {"step": 2, "perf/step_s": 42.0, "perf/eval_s": 30.0, "eval/pass@1": 0.85},
            {"step": 3, "perf/step_s": 11.0, "eval/pass@1": 0.9}]
    points = demo_distill.curve(rows)
    assert points == [(0, 0.0, 0.3), (2, 22.0, 0.85), (3, 33.0, 0.9)]
    s = demo_distill.summarize(0.95, {"distill": points, "grpo": points[:2]}, seed=3)
    assert s["target"] == pytest.approx(0.855)
    assert (s["distill"]["reached_step"], s["distill"]["reached_seconds"]) == (3, 33.0)
    assert s["grpo"]["reached_step"] is None and s["grpo"]["gain"] == pytest.approx(0.55)
    for argv, says in ((["--bogus=1"], "unknown argument '--bogus=1'"),
                       ([f"--teacher={tmp_path}"], "holds no config.json"),
                       ([f"--out_dir={tmp_path}", "--reuse_teacher"], "holds no finished run")):
        r = subprocess.run([sys.executable, "scripts/demo_distill.py", *argv], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and says in r.stderr, (argv, r.stderr)
