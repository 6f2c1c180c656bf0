# 8 GPUs on one node: Qwen2.5-1.5B-Instruct, 6 trainer ranks (FSDP2) + 2 vLLM generator ranks, bf16.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k.py
# Sized for 8 x 80 GB (H100/H200). Trainers: fp32 master weights + grads + AdamW (16 B/param) and the bf16-computed
# reference, sharded 6 ways: ~6 GB/rank plus activations. Each vLLM rank owns one GPU (dist.rank_env pins it):
# weights 3 GB + KV 16 GB + CUDA graphs, inside rollout.gpu_memory_utilization = 0.9 (72 GB, the default). KV per
# token is 28 layers x 2 KV heads x 128 x 2 (k, v) x 2 B = 28 KB: 192 completions x ~650 tokens need ~3.5 GB, and the
# rest lets eval's 660 prompts per rank run in few batches. rollout.enforce_eager stays None: CUDA graphs on.
model.path = "Qwen/Qwen2.5-1.5B-Instruct"   # or a local directory with the same files
model.dtype = "bfloat16"
data.name = "gsm8k"
data.source = "openai/gsm8k"                # or data/gsm8k/train.jsonl
data.instruction = "\nPlease reason step by step, and put your final answer within \\boxed{}."
rollout.prompts_per_step = 48               # B: 48 / 6 data-parallel ranks = 8 prompts per trainer rank
rollout.group_size = 8                      # G: 384 completions per step (192 per vLLM rank)
rollout.max_tokens = 512
rollout.kv_cache_mb = 16384                 # explicit KV bytes; must fit inside gpu_memory_utilization x 80 GB
rollout.max_staleness = 1                   # generate step s+1 while training on step s
loss.name = "grpo"
loss.kwargs = {"beta": 0.04}                # DeepSeekMath's KL coefficient; reference model on trainers
optim.lr = 1e-6
optim.warmup_steps = 10
optim.schedule = "cosine"
train.steps = 500
train.micro_batch = 16                      # 64 sequences per trainer rank / 16 = 4 accumulation steps
dist.generator_ranks = 2
dist.sync_bucket_mb = 512
eval.every = 50
eval.num_problems = 1319                    # the whole test split
eval.pass_k = 8
log.run = "gsm8k"
ckpt.every = 50
