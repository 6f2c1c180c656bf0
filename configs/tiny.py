# CPU, one process: the trainer and the torch generator colocated, on the synthetic arithmetic task.
#   python train_grpo.py configs/tiny.py
# The fastest layout on a small CPU box (measured, bench/vs_trl.py): a step costs 1.26 s here against 2.11 s with
# 1 trainer + 1 vLLM rank (torchrun gives each rank one core, so the update runs on one). The distributed layout:
#   torchrun --nproc_per_node=2 train_grpo.py configs/tiny.py --dist.generator_ranks=1 --rollout.backend=vllm
# Starts from the SFT demo's output when it exists, else from a random tiny checkpoint made on the spot
# (a fresh clone needs no prior step; that model answers nothing right, so reward stays ~0).
import os

model.path = "out/demo/sft/hf" if os.path.exists("out/demo/sft/hf/config.json") else "tiny:out/tiny/init"
model.dtype = "float32"             # not "auto": the demo's gains (docs/demo.md) were measured in fp32 on both boxes
data.name = "arith"
data.min_digits = 2                 # RL and eval on 2-digit operands (SFT saw 1-2 digits)
rollout.prompts_per_step = 32       # B
rollout.group_size = 8              # G: 32 x 8 = 256 completions per step, ~17 tokens each
rollout.max_tokens = 40
rollout.overlong_cache = 16         # DAPO's soft overlong punishment past 24 tokens (answers are <= 22): a reply that
                                    # never stops ("The answer is 76. The. The. ...") no longer scores like one that does
loss.name = "grpo"
loss.kwargs = {"beta": 0.0, "agg": "token_mean"}   # the calibrated setting: token-mean PG, no KL
loss.adv_eps = 1e-4
optim.lr = 1e-4                     # 3e-4 collapsed a seed, and 2e-4 still dipped 0.15 (docs/demo.md)
optim.warmup_steps = 20             # Adam's first steps are sign steps: at full lr step 1 alone moved 0.08 nats/token
optim.schedule = "cosine"           # to 0.1 x lr at the last step
optim.betas = (0.9, 0.99)
optim.grad_clip = 1.0
train.steps = 300                   # the demo: +0.15 to +0.37 held-out, 5 seeds x 2 paths x 2 boxes (docs/demo.md)
train.micro_batch = 256             # one forward/backward for the whole batch (tiny model)
dist.generator_ranks = 0             # colocated; rollout.backend "auto" = the torch generator on CPU
eval.every = 50
eval.num_problems = 500
log.run = "tiny"
