# SmolLM2-135M-Instruct on 1 GPU, colocated (the trainer and a vLLM engine share the device): GRPO on GSM8K.
#   python train_grpo.py configs/smollm2_1gpu.py
#   python train_grpo.py configs/smollm2_1gpu.py --model.path=$(python fetch_model.py)    (no hub access)
# 135M parameters: policy + reference + AdamW state in fp32 ~ 2.7 GB; the whole step fits with room to spare.
model.path = "HuggingFaceTB/SmolLM2-135M-Instruct"
model.dtype = "bfloat16"
data.name = "gsm8k"
data.source = "openai/gsm8k"                # or data/gsm8k/train.jsonl (eval_source: test.jsonl)
data.instruction = "\nPlease reason step by step, and put your final answer within \\boxed{}."
rollout.prompts_per_step = 64               # B
rollout.group_size = 8                      # G: 64 x 8 = 512 completions x <= 384 tokens per step
rollout.max_tokens = 384                    # 53% of greedy answers end within 256 tokens (notes); leave headroom
rollout.kv_cache_mb = 8192                  # bf16 KV: 30 layers x 3 kv heads x 64 x 2 x 2 B = 23 KB a token;
                                            # 512 rows x ~550 tokens (prompt + 384) x 23 KB ~ 6.5 GB < 8 GB
loss.name = "grpo"
loss.kwargs = {"beta": 0.04}
optim.lr = 1e-6
optim.warmup_steps = 10
train.steps = 500
train.micro_batch = 32                      # 512 sequences / 32 = 16 accumulation steps per optimizer step
dist.generator_ranks = 0                    # colocated
eval.every = 50
eval.num_problems = 500
log.run = "smollm2_1gpu"
ckpt.every = 50
