"""LoRA: train a low-rank update of the chosen Linears and leave the base model frozen.

Each adapted Linear (out x in weight W, frozen) gains two small trained matrices:

    y = W x + b + (alpha / r) * B A drop(x)        A: (r, in), B: (out, r), rank r << in, out

A starts random and B at zero, so step 0's policy is the base model exactly; only A and B get
gradients, AdamW state and grad clipping (LoRA, Hu et al. 2021, arXiv:2106.09685). For
policy-gradient RL the adapters can be tiny: an RL episode teaches a few bits, and "LoRA Without
Regret" (Thinking Machines Lab, 2025) matched full fine-tuning at very small ranks when every
linear layer of the blocks (the MLP too) is adapted and the learning rate is ~10x full
fine-tuning's (docs/lora.md).

What LoRA changes around the update, and where:
- the reference model (loss beta > 0) and log.drift's start are the policy with its adapters off
  (`Base`): no second copy of the weights;
- a weight sync sends what trains (weight_sync.py), the adapters: megabytes, not the model. The
  generator side folds them into the base checkpoint, W + (alpha / r) B A (`Merger`), and loads the
  merged weights exactly as a full-weight sync does, so vLLM, the torch generator's fast CPU
  decode, tied embeddings and multi-turn episodes see an ordinary checkpoint;
- checkpoints hold the adapters and their optimizer state only (checkpoint.py); the run's export is
  a merged Hugging Face checkpoint (<out>/hf, as without LoRA) and the adapter in PEFT's format
  (<out>/adapter: adapter_config.json + adapter_model.safetensors), which PEFT loads as is.

Parameter names stay Hugging Face's: the base weight of an adapted q_proj is still
`model.layers.0.self_attn.q_proj.weight`, its adapters `...q_proj.lora_A` and `...q_proj.lora_B`
(PEFT's key: `base_model.model.` + name + `.weight`).

Left out: LoRA on the embeddings or lm_head, QLoRA (a quantised base), DoRA and rsLoRA scaling,
tensor parallelism over adapted layers (refused at config time), vLLM's own LoRA serving (the
merge keeps the generator's forward the full-weight one: docs/lora.md#why-merge-on-the-generator).
"""
import contextlib
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import seeds
from model import checkpoint_files

# every Linear of a decoder block (model.py's Attention and MLP), the default target set
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Linear):
    """A Linear whose weight and bias are frozen, plus the trained low-rank update scale * B A."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same tensors, frozen
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        # fp32 master weights whatever the base's dtype: a bf16 base (run.load_model) stays frozen,
        # and AdamW's small steps would round away in a bf16 adapter
        kw = dict(dtype=torch.float32, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        self.scale, self.dropout, self.enabled = alpha / rank, dropout, True

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:  # Base: the reference model
            return y
        # dropout on the update's forward only: the no-grad scorings (old, reference) see the
        # adapter whole
        if self.dropout and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout)
        # under FSDP2's bf16 policy x and the gathered adapters are both bf16; unsharded, a bf16
        # base's x meets fp32 adapters, and the update is taken in fp32
        u = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scale
        return y + u.to(y.dtype)


def add(model, rank, alpha, targets=TARGETS, dropout=0.0, seed=0):
    """Swap every target Linear of model.py's blocks for a LoRALinear, in place, before sharding;
    freeze everything else. A is drawn as nn.Linear draws its weight, U(-1/sqrt(in), 1/sqrt(in)),
    from its own seeded stream: every rank draws the same A, so FSDP2 shards one tensor. Returns
    the model."""
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seeds.seed(seed, "lora_A"))
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in targets:
                if isinstance(getattr(parent, name, None), nn.Linear):
                    lin = LoRALinear(getattr(parent, name), rank, alpha, dropout)
                    bound = 1 / math.sqrt(lin.in_features)
                    a = torch.empty(lin.lora_A.shape).uniform_(-bound, bound, generator=g)
                    lin.lora_A.data.copy_(a)
                    setattr(parent, name, lin)
    return model


def adapted(model):
    """{module name: LoRALinear} (empty for a model without adapters)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_off(model):
    mods = adapted(model).values()
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


class Base:
    """The base model: `model` called with every adapter off. It scores like a frozen model (the
    reference for beta > 0, log.drift's start) and holds no weights of its own."""

    def __init__(self, model):
        self.model, self.cfg = model, model.cfg

    def __call__(self, *args, **kwargs):
        with adapters_off(self.model):
            return self.model(*args, **kwargs)


def fold(full, scale):
    """Full tensors {hf name: tensor} with adapters -> the merged ones, W + scale B A for each
    adapted module, in fp32; the adapters dropped. (The oracle for Merger.)"""
    out = {n: t for n, t in full.items() if not n.endswith((".lora_A", ".lora_B"))}
    for n in full:
        if n.endswith(".lora_A"):
            mod = n.removesuffix(".lora_A")
            delta = full[f"{mod}.lora_B"].float() @ full[n].float()
            out[f"{mod}.weight"] = out[f"{mod}.weight"].float() + scale * delta
    return out


class Merger:
    """A generator's side of a LoRA sync: the adapters it receives folded into the base checkpoint
    at `path`, as (hf name, fp32 tensor) in weight_sync's order (decoder blocks first, the rest
    last). The base is read per sync through safetensors' memory map: no second copy of it stays
    in memory, and the wire carries only the adapters."""

    def __init__(self, path, rank, alpha):
        self.path, self.scale = Path(path), alpha / rank
        tied = json.loads((self.path / "config.json").read_text()).get("tie_word_embeddings")
        files = checkpoint_files(path, bool(tied))

        def layer(n):
            return int(n.split(".")[2]) if n.startswith("model.layers.") else 1 << 30
        self.files = {n: files[n] for n in sorted(files, key=layer)}

    def __call__(self, named):
        """named: the received (name, tensor) adapters (views a later bucket may overwrite)."""
        ad = {n: t.float().clone() for n, t in named}
        # where the adapters arrived: on a GPU they are CUDA tensors (NCCL, or the colocated
        # trainer's), and each base tensor goes there to meet them, in its stored dtype (half the
        # bytes of fp32 for a bf16 checkpoint), one at a time
        device = next(iter(ad.values())).device if ad else torch.device("cpu")
        handles = {}
        for n, fname in self.files.items():
            if fname not in handles:
                handles[fname] = safe_open(self.path / fname, framework="pt")
            w, mod = handles[fname].get_tensor(n).to(device).float(), n.removesuffix(".weight")
            if f"{mod}.lora_A" in ad:
                # one fused op into one new tensor: `w += scale * (B @ A)` wrote two temporaries
                # and copied the memory-mapped page of w on write, 7-12x slower on CPU
                # (docs/lora.md#why-merge-on-the-generator)
                w = torch.addmm(w, ad[f"{mod}.lora_B"], ad[f"{mod}.lora_A"], alpha=self.scale)
            yield n, w


def peft_config(rank, alpha, targets, dropout, base_path):
    """PEFT's adapter_config.json for these adapters (PEFT 0.21's LoraConfig fields)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": sorted(targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
            "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
            "base_model_name_or_path": str(base_path)}


def save_adapter(full, path, config):
    """The adapters of `full` ({hf name: tensor}) in PEFT's format under `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{n}.weight": t.contiguous() for n, t in full.items()
               if n.endswith((".lora_A", ".lora_B"))}
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
