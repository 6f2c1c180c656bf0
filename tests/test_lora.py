"""LoRA (model.lora_rank; lora.py, docs/lora.md): the adapter against a slow reference and against
PEFT's own implementation, step 0 = the base model, only the adapters train, the reference is the
base with adapters off, the generator's merged weights against the adapted forward, and end to end
through the trainer: a vLLM rank under torchrun syncing adapters only, exact resume from a
checkpoint of the adapters, the exports (PEFT adapter, merged checkpoint vLLM opens), FSDP2 over two
trainers with multi-turn episodes, DAPO's refill and staleness 1."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

import lora
from conftest import ROOT
from model import Transformer

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11], [1, 2, 3, 4, 5, 6, 7, 8]])


def adapted(path, rank=4, alpha=8.0, targets=lora.TARGETS, perturb=True):
    """The checkpoint at `path` with adapters, B drawn at random (a zero B would hide every bug but
    the first)."""
    m = lora.add(Transformer.from_pretrained(path), rank, alpha, targets, seed=3)
    if perturb:
        g = torch.Generator().manual_seed(0)
        for mod in lora.adapted(m).values():
            mod.lora_B.data.copy_(torch.randn(mod.lora_B.shape, generator=g) * 0.05)
    return m


def test_step_zero_is_the_base_model_and_only_the_adapters_train(tiny_ckpt):
    """B = 0: the same logits bit for bit. requires_grad, the optimizer and the gradients cover the
    adapters alone: 7 targets x 2 matrices per block."""
    import run
    base = Transformer.from_pretrained(tiny_ckpt)
    m = adapted(tiny_ckpt, perturb=False)
    with torch.no_grad():
        assert torch.equal(m(IDS), base(IDS))
    trained = [n for n, p in m.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 7 * base.cfg.num_hidden_layers
    assert all(n.endswith((".lora_A", ".lora_B")) for n in trained)
    opt, _ = run.make_optimizer(m, type("O", (), dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0,
                                                      warmup_steps=0, schedule="constant",
                                                      min_lr_ratio=0.1))(), 10)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trained)
    m(IDS).float().logsumexp(-1).mean().backward()
    got = {n for n, p in m.named_parameters() if p.grad is not None}
    # at B = 0 only B's gradient is nonzero (dL/dA = scale B^T ...), but both exist
    assert got == set(trained)


def test_the_adapter_against_a_slow_reference_and_base_is_adapters_off(tiny_ckpt):
    """One adapted Linear equals W x + b + (alpha / r) sum_k B[:, k] (A[k] . x), row by row; the
    whole model with adapters off equals the base checkpoint exactly."""
    m = adapted(tiny_ckpt, rank=4, alpha=8.0)
    lin = m.model.layers[1].self_attn.q_proj
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(1))
    want = torch.stack([lin.weight @ row + (lin.bias if lin.bias is not None else 0)
                        + 2.0 * sum(lin.lora_B[:, k] * (lin.lora_A[k] @ row) for k in range(4))
                        for row in x])
    with torch.no_grad():
        assert torch.allclose(lin(x), want, atol=1e-5)
        assert not torch.allclose(m(IDS), Transformer.from_pretrained(tiny_ckpt)(IDS), atol=1e-3)
        assert torch.equal(lora.Base(m)(IDS), Transformer.from_pretrained(tiny_ckpt)(IDS))
        assert not torch.equal(m(IDS), lora.Base(m)(IDS))  # and on again after


def test_what_the_generator_loads_equals_the_adapted_forward(tiny_ckpt_untied):
    """lora.Merger (the generator's side of a sync: adapters in, base checkpoint + scale B A out)
    gives exactly lora.fold of the trainer's tensors, every parameter of a plain model once, decoder
    blocks first; loaded into a plain model its logits equal the adapted model's."""
    m = adapted(tiny_ckpt_untied, targets=("q_proj", "v_proj", "down_proj"))
    full = {n: p.detach() for n, p in m.named_parameters()}
    sent = [(n, t) for n, t in full.items() if n.endswith((".lora_A", ".lora_B"))]
    got = list(lora.Merger(tiny_ckpt_untied, 4, 8.0)(iter(sent)))
    plain = Transformer.from_pretrained(tiny_ckpt_untied)
    assert sorted(n for n, _ in got) == sorted(n for n, _ in plain.named_parameters())
    first_rest = next(i for i, (n, _) in enumerate(got) if not n.startswith("model.layers."))
    assert all(not n.startswith("model.layers.") for n, _ in got[first_rest:])
    want = lora.fold(full, 2.0)
    assert all(torch.equal(t, want[n].float()) for n, t in got)
    plain.load_state_dict(dict(got))
    with torch.no_grad():
        assert (plain(IDS) - m(IDS)).abs().max() < 1e-5


def test_the_merge_runs_where_the_adapters_arrive_meta_standing_in_for_cuda(tiny_ckpt_untied):
    """On a GPU the adapters a generator receives are CUDA tensors, and the base checkpoint is read
    on the CPU: the merge must bring each base tensor to the adapters' device. No CUDA here, so the
    meta device stands in for it (the shapes and names are checked; the values are the test
    above's)."""
    m = adapted(tiny_ckpt_untied, targets=("q_proj", "down_proj"))
    sent = [(n, p.detach().to("meta")) for n, p in m.named_parameters()
            if n.endswith((".lora_A", ".lora_B"))]
    got = list(lora.Merger(tiny_ckpt_untied, 4, 8.0)(iter(sent)))
    plain = dict(Transformer.from_pretrained(tiny_ckpt_untied).named_parameters())
    assert sorted(n for n, _ in got) == sorted(plain)
    assert all(t.device.type == "meta" and t.shape == plain[n].shape and t.dtype == torch.float32
               for n, t in got)


@pytest.mark.parametrize("name", sorted(__import__("losses").LOSSES))
def test_every_loss_trains_the_adapters_alone(tiny_ckpt, name):
    """A loss sees logprobs, never the model: each registered loss (a fork's too), with the
    reference scored by lora.Base where it takes a KL, gives a finite loss whose gradient reaches
    every adapter's B and no base weight."""
    import inspect
    import losses
    m = adapted(tiny_ckpt)
    x, y = IDS[:, :-1], IDS[:, 1:]
    logp = m(x, targets=y)
    with torch.no_grad():
        ref_logp = lora.Base(m)(x, targets=y)
        old_logp = logp.detach() - 0.01 * torch.arange(y.shape[1]) / y.shape[1]
    mask = torch.ones_like(logp)
    mask[1, -2:] = 0
    adv = torch.tensor([[1.0], [-0.5]]).expand_as(logp)
    params = inspect.signature(losses.LOSSES[name]).parameters
    kw = {k: v for k, v in dict(beta=0.04, max_tokens=y.shape[1]).items() if k in params}
    loss, _ = losses.LOSSES[name](**kw)(logp, ref_logp, adv, mask, old_logprobs=old_logp)
    loss.backward()
    assert torch.isfinite(loss), name
    assert all(p.grad is None for n, p in m.named_parameters() if not n.endswith(".lora_B")
               and not n.endswith(".lora_A")), name
    assert all(mod.lora_B.grad is not None and mod.lora_B.grad.abs().sum() > 0
               for mod in lora.adapted(m).values()), name


def test_peft_loads_the_saved_adapter_and_its_logits_equal_ours(tiny_ckpt, tmp_path):
    """The oracle for the format and the math: PEFT puts our adapter_config.json and
    adapter_model.safetensors onto transformers' model of the base checkpoint; its logits equal
    ours (and differ from the base's, so the adapter was applied)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    m = adapted(tiny_ckpt, rank=8, alpha=16.0)
    full = {n: p.detach() for n, p in m.named_parameters()}
    lora.save_adapter(full, tmp_path / "adapter",
                      lora.peft_config(8, 16.0, lora.TARGETS, 0.0, tiny_ckpt))
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs, ours = peft_model(IDS).logits, m(IDS)
    assert (theirs - ours).abs().max() < 1e-5
    with torch.no_grad(), peft_model.disable_adapter():
        assert (peft_model(IDS).logits - ours).abs().max() > 1e-3


@pytest.mark.parametrize("args, message", [
    (["--model.lora_rank=-1"], "model.lora_rank=-1 must be >= 0"),
    (["--model.lora_rank=8", "--model.lora_alpha=0"], "model.lora_alpha=0.0 must be > 0"),
    (["--model.lora_rank=8", "--model.lora_targets=('q_prj',)"],
     "no Linear 'q_prj' in a block (did you mean 'q_proj'?); valid: q_proj, k_proj"),
    (["--model.lora_rank=8", "--model.lora_targets=()"], "model.lora_targets is empty"),
    (["--model.lora_rank=8", "--model.lora_dropout=1.0"], "model.lora_dropout=1.0 must be in"),
])
def test_config_errors_name_the_field(args, message, monkeypatch):
    import checks
    import config
    import train_grpo
    monkeypatch.chdir(ROOT)
    cfg = train_grpo.parse_config(["configs/tiny.py", "--dist.generator_ranks=0", *args])
    with pytest.raises(config.ConfigError) as e:
        checks.grpo(cfg, 1)
    assert message in str(e.value)


def test_tensor_parallel_is_refused_with_lora(monkeypatch):
    import checks
    import config
    import train_grpo
    monkeypatch.chdir(ROOT)
    cfg = train_grpo.parse_config(["configs/tiny.py", "--dist.generator_ranks=0",
                                   "--model.lora_rank=8", "--dist.tp=2",
                                   "--rollout.prompts_per_step=2"])
    with pytest.raises(config.ConfigError, match="LoRA is not built for tensor-parallel"):
        checks.grpo(cfg, 2)


BF16_BASE = """
import json, sys, torch
import dist, lora, run, train_grpo
from model import Transformer
ckpt, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
roles = dist.get_roles(0)
dist.init_distributed(roles)
mesh = dist.trainer_mesh(roles, 1, 1)
cfg = train_grpo.parse_config(["configs/tiny.py", "--dist.generator_ranks=0",
                               "--model.dtype=bfloat16", "--model.lora_rank=4",
                               f"--model.path={ckpt}"])
new = run.load_model(ckpt, roles.device, mesh, cfg, adapters=cfg.model)
# the old way: an fp32 base, cast to bf16 by FSDP2 at each gather
old = lora.add(Transformer.from_pretrained(ckpt), 4, cfg.model.lora_alpha,
               cfg.model.lora_targets, seed=cfg.train.seed)
old = dist.shard_model(old, mesh, param_dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
for a, b in zip(lora.adapted(new).values(), lora.adapted(old).values()):
    B = torch.randn(a.lora_B.shape, generator=g) * 0.05
    with torch.no_grad():
        a.lora_B.to_local().copy_(B), b.lora_B.to_local().copy_(B)
out = {}
for name, m in (("new", new), ("old", old)):
    y = m(ids)
    y.float().logsumexp(-1).mean().backward()
    grads = [p.grad.to_local().clone() for p in m.parameters() if p.requires_grad]
    frozen = [p for p in m.parameters() if not p.requires_grad]
    trained = [p for p in m.parameters() if p.requires_grad]
    out[name] = dict(y=y, grads=grads,
                     base_dtypes=sorted({str(p.dtype) for p in frozen}),
                     adapter_dtypes=sorted({str(p.dtype) for p in trained}),
                     base_bytes=sum(p.to_local().nbytes for p in frozen))
teacher = run.load_model(ckpt, roles.device, mesh, cfg, frozen=True)
print(json.dumps(dict(
    same_logits=torch.equal(out["new"]["y"], out["old"]["y"]),
    same_grads=all(torch.equal(a, b) for a, b in zip(out["new"]["grads"], out["old"]["grads"])),
    **{f"{k}_{n}": v for n, o in out.items() for k, v in o.items() if k not in ("y", "grads")},
    teacher_dtypes=sorted({str(p.dtype) for p in teacher.parameters()}))))
"""


def test_a_bf16_run_stores_the_frozen_base_in_bf16_with_the_same_numbers(tiny_ckpt):
    """model.dtype = bfloat16 with LoRA: the frozen base is stored in bf16 (half the bytes), the
    adapters keep fp32 master weights, and FSDP2's forward and the adapters' gradients are bit for
    bit those of an fp32-stored base (which FSDP2 casts to the same bf16 numbers at each gather).
    A frozen model (a teacher, the reference without LoRA) is stored in bf16 likewise."""
    p = subprocess.run([sys.executable, "-c", BF16_BASE, str(tiny_ckpt), json.dumps(IDS.tolist())],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.splitlines()[-1])
    assert r["same_logits"] and r["same_grads"], r
    assert r["base_dtypes_new"] == ["torch.bfloat16"] and r["base_dtypes_old"] == ["torch.float32"]
    assert r["adapter_dtypes_new"] == r["adapter_dtypes_old"] == ["torch.float32"], r
    assert r["base_bytes_new"] * 2 == r["base_bytes_old"], r
    assert r["teacher_dtypes"] == ["torch.bfloat16"], r


# ---- through the trainer ----------------------------------------------------------------------

def run(args, tmp_path, nproc=0, timeout=420):
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
                if nproc else [sys.executable])
    return subprocess.run([*launcher, "train_grpo.py", "configs/tiny.py",
                           "--rollout.prompts_per_step=8", "--rollout.group_size=2",
                           "--rollout.max_tokens=24", "--eval.every=0", "--eval.num_problems=16",
                           "--dist.timeout_s=120", f"--log.out_dir={tmp_path}",
                           "--model.lora_rank=8", "--optim.lr=0.01", "--optim.warmup_steps=0",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def rows(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")
            if "perf/step_s" in json.loads(line)]


def adapter_bytes(ckpt, rank=8):
    """fp32 A and B of every Linear of every block."""
    cfg = json.loads((ckpt / "config.json").read_text())
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # (in, out)
    return L * sum(4 * rank * (a + b) for a, b in shapes)


@pytest.mark.slow
def test_a_vllm_rank_gets_adapters_only_and_a_resume_is_exact(tmp_path, tiny_ckpt):
    """1 trainer + 1 vLLM rank, LoRA rank 8 with a KL to the base (beta > 0: the reference is the
    policy with adapters off): each sync carries exactly the adapters' bytes, the vLLM engine's
    logprobs match the trainer's (the merge is exact), the checkpoint holds no base weight, and a
    run resumed at step 2 repeats steps 3-4. The exports: vLLM opens the merged checkpoint and
    greedy-decodes as our generator does; PEFT puts the adapter on the base and its logits equal
    the merged checkpoint's."""
    from conftest import export_greedy
    common = ["--dist.generator_ranks=1", "--rollout.backend=vllm", "--rollout.kv_cache_mb=32",
              f"--model.path={tiny_ckpt}", "--train.steps=4", "--ckpt.every=2",
              "--loss.kwargs={'beta': 0.04}"]
    a = run([*common, "--log.run=a"], tmp_path, nproc=2)
    assert a.returncode == 0, a.stderr[-4000:]
    ra = rows(tmp_path / "a")
    assert all(r["sync/bytes"] == adapter_bytes(tiny_ckpt) for r in ra), ra
    assert all(r["mismatch/abs_diff"] < 1e-5 for r in ra), ra
    assert ra[0]["loss/kl"] == 0 and ra[-1]["loss/kl"] > 1e-4, ra  # step 1 is the base exactly
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(tmp_path / "a" / "ckpt" / "step_2").read_metadata()
    saved = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert saved and all(k.endswith((".lora_A", ".lora_B")) for k in saved), saved[:4]
    shutil.copytree(tmp_path / "a" / "ckpt" / "step_2", tmp_path / "b" / "ckpt" / "step_2")
    b = run([*common, "--log.run=b", "--ckpt.resume=auto"], tmp_path, nproc=2)
    assert b.returncode == 0, b.stderr[-4000:]
    for x, y in zip(ra[2:], rows(tmp_path / "b"), strict=True):
        for k in ("loss/total", "loss/kl", "train/grad_norm", "rollout/reward_mean"):
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9), k

    hf, adapter = tmp_path / "a" / "hf", tmp_path / "a" / "adapter"
    prompts = [[5, 17, 42, 99], [1, 2, 3]]
    ours, vllm = export_greedy(hf, prompts, max_tokens=12)
    assert ours == vllm
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        merged = Transformer.from_pretrained(hf)(IDS)
        assert (peft_model(IDS).logits - merged).abs().max() < 1e-5
        assert (Transformer.from_pretrained(tiny_ckpt)(IDS) - merged).abs().max() > 1e-4


# ~3 of 4 groups unanimous (tests/test_train_grpo.py's SPARSE_REWARD): DAPO's refill has work
SPARSE = """
class Sparse:
    def __call__(self, prompt, response, target):
        return float(len(response) % 2) if int(target) % 4 == 0 else 0.0
"""


@pytest.mark.slow
def test_fsdp2_trainers_with_episodes_refill_and_staleness(tmp_path, tiny_ckpt):
    """Two colocated trainers (FSDP2 over the frozen base and its adapters, activation
    checkpointing), multi-turn retry episodes, DAPO's refill and one step of staleness, log.drift
    against the base: finite, the torch generator's merged weights match the trainer's logprobs
    (step 1, the one batch not sampled a version behind), only adapters sync, and the policy moves
    away from its base."""
    (tmp_path / "sparse.py").write_text(SPARSE)
    res = run([f"--model.path={tiny_ckpt}", "--dist.generator_ranks=0", "--rollout.backend=torch",
               "--dist.activation_checkpointing=true", "--rollout.env=retry",
               "--rollout.max_turns=2", f"--rollout.rewards={{'{tmp_path}/sparse.py:Sparse': 1.0}}",
               f"--rollout.accuracy={tmp_path}/sparse.py:Sparse", "--rollout.group_size=4",
               "--rollout.filter_zero_std=true",
               "--rollout.refill_rounds=8", "--loss.name=dapo", "--loss.kwargs={}",
               "--rollout.max_staleness=1", "--log.drift=true", "--train.steps=3",
               "--log.run=fsdp"], tmp_path, nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    rs = rows(tmp_path / "fsdp")
    assert rs[0]["mismatch/abs_diff"] < 1e-5, rs[0]  # later steps train on a batch a version old
    for r in rs:
        assert r["sync/bytes"] == adapter_bytes(tiny_ckpt), r
        assert all(torch.isfinite(torch.tensor(v)) for v in r.values() if isinstance(v, float))
    assert rs[-1]["episode/turns"] > 1 and sum(r["rollout/refill_rounds"] for r in rs) > 0, rs
    assert rs[-1]["drift/kl_start"] > 0, rs[-1]
