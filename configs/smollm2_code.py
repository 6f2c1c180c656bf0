# SmolLM2-135M-Instruct on the embedded code task (tasks.make_code: "Write a Python function f(x) that returns ...",
# 4 hidden tests each), rewarded by the sandboxed code reward (rewards.CodeReward, sandbox.py), on CPU, one process.
# What it learns in 10 steps is in docs/sandbox.md.
#   python train_grpo.py configs/smollm2_code.py --rollout.backend=vllm

include("smollm2_cpu.py")  # the CPU base
model.dtype = "float32"             # not "auto": what it learns was measured in fp32 (bf16: 0.037 nats/token mismatch)
data.name = "code"
data.instruction = ""               # the question itself says what to write
rollout.rewards = {"code": 1.0}     # the fraction of tests passed by the reply's last ```python block
rollout.accuracy = "code"           # held-out pass@1: all tests passed
rollout.max_tokens = 64             # a one-line function in a fence is ~25 tokens
rollout.temperature = 0.7
rollout.reward_timeout_s = 3.0      # above the reward's 1 s sandbox limit plus its ~0.1 s start
train.steps = 10
eval.every = 5
eval.num_problems = 100
log.run = "smollm2_code"
