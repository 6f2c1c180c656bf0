# GRPO on GSM8K with a Llama 3.x model: the 8-GPU setup of configs/gsm8k.py, Llama-3.2-1B-Instruct instead.
#   torchrun --nproc_per_node=8 train_grpo.py configs/gsm8k_llama.py
# model.py reads Llama's config.json as is (llama3 rope scaling, tied embeddings for the 1B/3B models), and
# data.Tokenizer takes the eos ids from generation_config.json (<|eot_id|> ends an assistant turn).
# NOTE: meta-llama repositories are gated: accept the licence on the hub and `huggingface-cli login` first,
# or point model.path at a local copy.

include("gsm8k.py")  # the 8-GPU base
model.path = "meta-llama/Llama-3.2-1B-Instruct"
loss.name = "grpo"
loss.kwargs = {"beta": 0.04}        # DeepSeekMath's KL coefficient (docs/losses-spec.md section 4)
optim.lr = 1e-6
log.run = "gsm8k_llama"
