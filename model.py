"""The policy network: a Llama-family decoder (Llama 3.x, Qwen2/2.5, Qwen3) in plain PyTorch.

Every block is the same pre-norm residual pair
    x = x + Attn(RMSNorm(x));   x = x + MLP(RMSNorm(x))
    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)          (computed in fp32, cast back)
    MLP(x)     = down(silu(gate(x)) * up(x))            (SwiGLU)
    Attn       = causal softmax(q k^T / sqrt(head_dim)) v with grouped-query attention (GQA):
                 H query heads share H_kv key/value heads, H / H_kv queries per group.
RoPE rotates each (q, k) pair of channels (i, i + head_dim/2) by angle pos * inv_freq[i],
    inv_freq[i] = rope_theta ** (-2i / head_dim).
The three families differ only in small switches (all read from the checkpoint's config.json):
- llama: no biases. Llama 3.1+ adds `rope_scaling` type "llama3", which stretches long wavelengths
  for long context: with L = original_max_position_embeddings and wavelen = 2 pi / inv_freq,
      wavelen < L / high_freq_factor  -> inv_freq unchanged        (high frequencies: local order)
      wavelen > L / low_freq_factor   -> inv_freq / factor         (low frequencies: interpolated)
      otherwise                       -> (1 - s) inv_freq / factor + s inv_freq,
                                         s = (L / wavelen - low_freq_factor)
                                             / (high_freq_factor - low_freq_factor)
- qwen2 (Qwen2 / Qwen2.5): q, k and v projections carry a bias.
- qwen3: no biases, but an RMSNorm over head_dim on every q and k head before RoPE ("qk-norm"), and
  head_dim is decoupled from hidden_size / num_heads.
Embeddings may be tied (lm_head.weight is the same Parameter as model.embed_tokens.weight) or not.

Parameter names are exactly the Hugging Face ones, so checkpoints load and save, and weights sync to
vLLM, with no renaming. Batches may be left- or right-padded (attention_mask,
positions = cumsum(mask) - 1, so a padded row gives the logits of the same sequence alone);
positions that restart at 0 without a mask mean packed documents, which attend only within
themselves. A KV cache (kvcache.py) lets the same forward prefill and decode.
Shared prompts (`forward(..., prefix=(prompt_ids, prompt_mask, rows))`): GRPO scores G completions
of every prompt, and causal attention makes the prompt's states the same in all G rows, so each
distinct prompt is run once and every completion row attends to its prompt's keys and values
(SharedPrefix). Same logprobs and gradients as the padded full batch, with G - 1 of every G prompt
tokens no longer computed (about half a GRPO step's tokens).
With `prefix=(prompt_ids, prompt_mask, None, mask_c)` the completion rows are packed (packing.py):
row r holds several completions, and mask_c lets each token see its own prompt and its own
completion.
`forward(..., targets=...)` returns fp32 per-token log-probs
log_softmax(logits / temperature)[target] (and optionally the entropy) computed chunk by chunk, so
the (B, T, V) fp32 tensor never exists at once, in the forward nor (through per-chunk recomputation)
in the backward.

Left out on purpose: MoE, sliding-window attention, other RoPE scalings (yarn, dynamic, linear),
partial rotary, mlp bias, tensor-parallel-aware shapes beyond
"heads are inferred with view(..., -1, head_dim)", quantisation.
"""
import json
import math
import shutil
from dataclasses import dataclass, asdict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt",
                   "tokenizer.model")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3", factor, low/high_freq_factor,
    #                            original_max_pos...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool       # q/k/v bias (qwen2: always)
    qk_norm: bool              # per-head RMSNorm on q and k (qwen3)

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Both dialects: the Hub's top-level rope_theta/rope_scaling, and transformers 5's
        rope_parameters."""
        def need(key, where=d):
            if key not in where or where[key] is None:
                raise ValueError(f"{source}: missing config field '{key}'")
            return where[key]

        model_type = need("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"{source}: unsupported model_type '{model_type}' "
                             f"(supported: {list(ARCHITECTURES)})")
        for key, ok in (("hidden_act", "silu"), ("mlp_bias", False), ("use_sliding_window", False)):
            if d.get(key, ok) != ok:
                raise ValueError(
                    f"{source}: field '{key}'={d[key]!r} is not supported (only {ok!r})")
        rope = d.get("rope_parameters") or {**(d.get("rope_scaling") or {}),
                                            "rope_theta": d.get("rope_theta")}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{source}: rope type '{rope_type}' is not supported "
                             "(only default and llama3)")
        rope_scaling = None
        if rope_type == "llama3":
            rope_scaling = {"rope_type": "llama3"}
            for key in ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"):
                rope_scaling[key] = need(key, rope)
        heads = need("num_attention_heads")
        return cls(model_type=model_type, vocab_size=need("vocab_size"),
                   hidden_size=need("hidden_size"), intermediate_size=need("intermediate_size"),
                   num_hidden_layers=need("num_hidden_layers"), num_attention_heads=heads,
                   num_key_value_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or need("hidden_size") // heads,
                   rms_norm_eps=need("rms_norm_eps"),
                   rope_theta=float(need("rope_theta", rope)), rope_scaling=rope_scaling,
                   max_position_embeddings=need("max_position_embeddings"),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
                   qk_norm=model_type == "qwen3")

    def to_hf(self) -> dict:
        """A config.json that transformers 5 and vLLM open (transformers 5 dialect, plus top-level
        rope_theta)."""
        d = asdict(self)
        rope_scaling, qk_norm = d.pop("rope_scaling"), d.pop("qk_norm")
        if self.model_type == "qwen2":
            d.pop("attention_bias")  # implied by the architecture
        d["rope_parameters"] = {"rope_theta": self.rope_theta,
                                **(rope_scaling or {"rope_type": "default"})}
        return {"architectures": [ARCHITECTURES[self.model_type]], **d, "hidden_act": "silu",
                "use_cache": True}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)
                                               + self.eps)).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, device=None):
    """inv_freq (head_dim/2,) fp32, with llama3 scaling applied when configured (math in the module
    docstring)."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float()
                                        / cfg.head_dim)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    L, lo, hi, factor = (s["original_max_position_embeddings"], s["low_freq_factor"],
                         s["high_freq_factor"], s["factor"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (L / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > L / lo, inv_freq / factor, inv_freq)
    medium = (wavelen >= L / hi) & (wavelen <= L / lo)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def apply_rope(x, cos, sin):  # x (B, H, T, D); cos, sin (B, 1, T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def mask_positions(attention_mask):
    """(B, S) 1 = real token -> positions counting real tokens from 0, whatever the padding side."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def block_causal(doc):
    """doc (B, T): which document each token belongs to -> (B, T, T) bool: a token sees the earlier
    tokens of its own document. The block-diagonal causal mask of packed rows (SFT's, and
    packing.packed_mask's)."""
    T = doc.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return causal & (doc[:, :, None] == doc[:, None, :])


def padding_mask(attention_mask, q_start, T):
    """(B, S) 1 = real key -> (B, 1, T, S) bool for queries at positions q_start..q_start+T-1:
    causal and real. The diagonal stays on, so a pad query attends to itself instead of nothing
    (NaN); its output is never used."""
    dev, S = attention_mask.device, attention_mask.shape[1]
    q_pos, k_pos = torch.arange(q_start, q_start + T, device=dev), torch.arange(S, device=dev)
    mask = ((k_pos[None, :] <= q_pos[:, None]) & attention_mask.bool()[:, None, :]
            | (k_pos[None, :] == q_pos[:, None]))
    return mask[:, None]


@dataclass
class SharedPrefix:
    """How one flat sequence of N = U*Pp + B*T tokens splits: U distinct prompts of Pp tokens
    (left-padded), then B completion rows of T tokens, row b continuing prompt rows[b]. Passed to
    the blocks in place of the mask: norms, MLPs and projections act per token on the flat sequence
    (one call per block, so FSDP2's hooks see one forward), attention is the only place rows meet.
    Sizes are read off the masks: torch.compile (dist.compile) then sees tensor dimensions, symbolic
    after a second shape, not ints it would recompile for at every new length."""
    rows: torch.Tensor      # (B,) index of each completion row's prompt; None: packed rows
    mask_p: torch.Tensor    # (U, 1, Pp, Pp) causal + prompt padding
    mask_c: torch.Tensor    # (B, 1, T, Pp + T) a completion row sees its prompt, then itself
    #                         causally
    #                         packed: (B, 1, T, U*Pp + T), every prompt's keys, each token its own
    #                         prompt's only
    U, Pp = property(lambda self: self.mask_p.shape[0]), property(lambda self: self.mask_p.shape[2])
    B, T = property(lambda self: self.mask_c.shape[0]), property(lambda self: self.mask_c.shape[2])

    def attend(self, q, k, v):
        """q (1, H, N, D), k and v (1, H_kv, N, D) -> (1, H, N, D)."""
        n = self.U * self.Pp

        def split(x):  # -> prompts (U, h, Pp, D), completions (B, h, T, D)
            h, d = x.shape[1], x.shape[3]
            return (x[0, :, :n].reshape(h, self.U, self.Pp, d).transpose(0, 1),
                    x[0, :, n:].reshape(h, self.B, self.T, d).transpose(0, 1))
        (qp, qc), (kp, kc), (vp, vc) = split(q), split(k), split(v)
        gqa = q.shape[1] != k.shape[1]
        yp = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=self.mask_p, enable_gqa=gqa)
        # the prompt's keys are gathered per row: in backward their gradients sum over the G rows
        # sharing them
        if self.rows is None:
            # packed rows hold completions of different prompts: all U prompts, masked per token
            kp, vp = (x[:, :, :n].expand(self.B, -1, -1, -1) for x in (k, v))
        else:
            kp, vp = kp[self.rows], vp[self.rows]
        yc = F.scaled_dot_product_attention(qc, torch.cat([kp, kc], 2), torch.cat([vp, vc], 2),
                                            attn_mask=self.mask_c, enable_gqa=gqa)
        H, D = q.shape[1], q.shape[3]
        return torch.cat([yp.transpose(0, 1).reshape(H, n, D),
                          yc.transpose(0, 1).reshape(H, -1, D)], 1)[None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        D, H, H_kv, bias = (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.attention_bias)
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, H_kv * D, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, H_kv * D, bias=bias)
        # HF llama/qwen3 put attention_bias on o_proj as well; qwen2 biases q, k, v only
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=bias and cfg.model_type != "qwen2")
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(D, cfg.rms_norm_eps), RMSNorm(D, cfg.rms_norm_eps)
        self.head_dim, self.layer_idx, self.qk_norm = D, layer_idx, cfg.qk_norm

    # on CPU the torch generator takes the three products as one stacked matmul
    # (machine.OneDNNLinears)
    def qkv(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, mask, kv_cache, cache_pos):
        B, T, _ = x.shape
        # view(..., -1, D): the head count follows the weights, so a tensor-parallel shard just has
        # fewer heads
        q, k, v = (y.view(B, T, -1, self.head_dim) for y in self.qkv(x))
        v = v.transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # (B, H, T, D)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if kv_cache is not None:
            kv_cache.k[self.layer_idx, :, :, cache_pos:cache_pos + T] = k
            kv_cache.v[self.layer_idx, :, :, cache_pos:cache_pos + T] = v
            k = kv_cache.k[self.layer_idx, :, :, :cache_pos + T]
            v = kv_cache.v[self.layer_idx, :, :, :cache_pos + T]
        dtype, gqa = q.dtype, q.shape[1] != k.shape[1]
        if dtype == torch.bfloat16 and q.device.type == "cpu" and kv_cache is None:
            # CPU's bf16 flash-attention backward: 4x slower than fp32's (bench/update.py), for a
            # few % of the FLOPs
            q, k, v = q.float(), k.float(), v.float()
        if isinstance(mask, SharedPrefix):
            y = mask.attend(q, k, v)
        elif T == 1 and kv_cache is not None:
            y = kv_cache.attend(q, k, v, mask, self.layer_idx)  # kvcache.py
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=gqa)
        return self.o_proj(y.to(dtype).transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def gate_up(self, x):  # as Attention.qkv
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x):
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv_cache, cache_pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, cache_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class ChunkLogp(torch.autograd.Function):
    """One chunk's fp32 logp = log_softmax(z)[t] and entropy H = -sum_v p_v log p_v,
    z = (h W^T) / temperature, with the backward written out instead of left to autograd. Only the
    chunk's input h is saved; backward recomputes its logits once and forms the logits' gradient in
    closed form,
        dlogp/dz = onehot(t) - p,      dH/dz = -p * (log p + H)        (then / temperature),
    in place in one (n, V) buffer: a handful of passes over the chunk's logits instead of autograd's
    chain of div, log_softmax, gather, exp and mul, each with its own backward and saved (n, V)
    tensors."""

    @staticmethod
    def forward(ctx, h, weight, t, temperature, return_entropy):
        # an entropy used only for logging (detached) gets None: the cheap backward
        ctx.set_materialize_grads(False)
        logp_all = ChunkLogp._log_softmax(h, weight, temperature)
        logp = logp_all.gather(-1, t[:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1) if return_entropy else None
        ctx.save_for_backward(h, weight, t, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, t, ent = ctx.saved_tensors
        logp_all = ChunkLogp._log_softmax(h, weight, ctx.temperature)
        p = logp_all.exp()
        g_logp = torch.zeros_like(t, dtype=torch.float32) if g_logp is None else g_logp
        # reused in place: -p * (g_logp + g_ent * (log p + H)), then + g_logp at the target
        grad = logp_all
        if ent is not None and g_ent is not None:
            grad.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_logp[:, None]).mul_(p).neg_()
        else:
            grad = p.mul_(-g_logp[:, None])
        grad.scatter_add_(-1, t[:, None], g_logp[:, None])
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(h.dtype)
        grad_h = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.T @ h if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None

    @staticmethod
    def _log_softmax(h, weight, temperature):
        z = F.linear(h, weight).float()
        # (n, V): one chunk
        return torch.log_softmax(z if temperature == 1.0 else z.div_(temperature), dim=-1)


def chunked_logprobs(hidden, lm_head, targets, temperature=1.0, return_entropy=False, chunk=1024):
    """hidden (B, T, D) final-norm states, lm_head: (n, D) -> (n, V), targets (B, T) token ids.
    Returns logp (B, T) fp32 = log_softmax(lm_head(hidden).float() / temperature)[targets]
    (+ entropy (B, T)), `chunk` tokens at a time (ChunkLogp). Under autograd every chunk saves only
    its (n, D) input and recomputes its logits in backward, so neither pass holds more than one
    chunk's (chunk, V) fp32 tensors."""
    B, T, D = hidden.shape
    h, t = hidden.reshape(B * T, D), targets.reshape(B * T)
    outs = [ChunkLogp.apply(h[i:i + chunk], lm_head.weight, t[i:i + chunk], temperature,
                            return_entropy)
            for i in range(0, B * T, chunk)]
    # clone: FSDP2 warns about view outputs (an in-place op on one would bypass its backward hooks);
    # (B, T) is cheap
    res = [torch.cat(parts).view(B, T).clone() for parts in zip(*outs) if parts[0] is not None]
    return tuple(res) if return_entropy else res[0]


def checkpoint_files(path, tied: bool) -> dict:
    """{tensor name: safetensors file} of a Hugging Face checkpoint, sharded (an index) or not,
    without the redundant copies some exporters write: a tied lm_head, rotary caches."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(path / "model.safetensors", framework="pt") as f:
            files = dict.fromkeys(f.keys(), "model.safetensors")
    return {n: f for n, f in files.items()
            if "rotary_emb" not in n and not (n == "lm_head.weight" and tied)}


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # HF-style init; skipped on the meta device (from_pretrained)
        for name, p in self.named_parameters():
            if not p.is_meta and name.endswith("bias"):
                nn.init.zeros_(p)
            elif not p.is_meta and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids=None, attention_mask=None, *, targets=None,
                temperature=1.0, return_entropy=False, kv_cache=None, cache_pos=0,
                logits_chunk=1024, prefix=None):
        B, T = input_ids.shape
        if prefix is not None:
            # (prompt_ids, prompt_mask, rows) or (prompt_ids, prompt_mask, None, mask_c)
            input_ids, position_ids, mask = self._shared_prefix(input_ids, attention_mask,
                                                                position_ids, *prefix)
        else:
            position_ids, mask = self._positions_and_mask(input_ids, position_ids, attention_mask,
                                                          kv_cache, cache_pos)
        # (B, 1, T, D/2)
        freqs = position_ids[:, None, :, None].float() * rope_inv_freq(self.cfg, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = (freqs.cos().repeat(1, 1, 1, 2).to(x.dtype),
                    freqs.sin().repeat(1, 1, 1, 2).to(x.dtype))
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, kv_cache, cache_pos)
        if prefix is not None:  # the completion rows; the prompts' last-layer outputs feed no logit
            x = x[0, mask.U * mask.Pp:].view(B, T, -1)
        x = self.model.norm(x)
        if targets is None:
            return self.lm_head(x)  # (B, T, V) in the model dtype
        return chunked_logprobs(x, self.lm_head, targets, temperature, return_entropy, logits_chunk)

    def _positions_and_mask(self, input_ids, position_ids, attention_mask, kv_cache, cache_pos):
        B, T = input_ids.shape
        S, dev = cache_pos + T, input_ids.device
        if attention_mask is not None and attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask must be (B, cache_pos + T) = {(B, S)}, "
                             f"got {tuple(attention_mask.shape)}")
        packed = position_ids is not None and attention_mask is None and kv_cache is None and T > 1
        if position_ids is None:
            if attention_mask is not None:
                position_ids = mask_positions(attention_mask)[:, cache_pos:]
            else:
                position_ids = torch.arange(cache_pos, S, device=dev).expand(B, T)
        # one new token: it sees every cached key
        if attention_mask is not None or cache_pos > 0 and T > 1:
            if attention_mask is None:
                attention_mask = torch.ones(B, S, dtype=torch.bool, device=dev)
            return position_ids, padding_mask(attention_mask, cache_pos, T)
        # packed documents (no padding, positions restart at 0): attend within the same
        # document only
        if packed:
            return position_ids, block_causal((position_ids == 0).cumsum(-1))[:, None]
        return position_ids, None  # None -> plain causal (SDPA's fast path)

    @staticmethod
    def _shared_prefix(ids, attention_mask, position_ids, prompt_ids, prompt_mask, rows,
                       mask_c=None):
        """-> the flat (1, U*Pp + B*T) ids, their positions, and the SharedPrefix layout. Padded
        rows need attention_mask (B, Pp + T); packed rows (mask_c given, packing.packed_mask) need
        position_ids (B, T)."""
        (B, T), (U, Pp) = ids.shape, prompt_ids.shape
        if mask_c is None:
            if attention_mask is None or attention_mask.shape != (B, Pp + T):
                raise ValueError(f"prefix needs attention_mask (B, Pp + T) = {(B, Pp + T)}")
            position_ids, mask_c = (mask_positions(attention_mask)[:, Pp:],
                                    padding_mask(attention_mask, Pp, T))
        elif position_ids is None or mask_c.shape != (B, 1, T, U * Pp + T):
            raise ValueError(f"packed prefix needs position_ids (B, T) and mask_c "
                             f"(B, 1, T, U*Pp + T) = {(B, 1, T, U * Pp + T)}")
        layout = SharedPrefix(rows, padding_mask(prompt_mask, 0, Pp), mask_c)
        position_ids = torch.cat([mask_positions(prompt_mask).reshape(1, -1),
                                  position_ids.reshape(1, -1)], 1)
        return torch.cat([prompt_ids.reshape(1, -1), ids.reshape(1, -1)], 1), position_ids, layout

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "Transformer":
        path = Path(path)
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()),
                                  str(path / "config.json"))
        with torch.device("meta"):  # no random init: every tensor comes from the checkpoint
            model = cls(cfg)
        expected = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
        files = checkpoint_files(path, cfg.tie_word_embeddings)
        state = {}
        for fname in sorted(set(files.values())):
            with safe_open(path / fname, framework="pt", device="cpu") as f:
                for name in (n for n, fn in files.items() if fn == fname):
                    if name not in expected:
                        raise ValueError(
                            f"{path / fname}: unexpected tensor '{name}' for this config")
                    t = f.get_tensor(name)
                    if t.shape != expected[name].shape:
                        raise ValueError(f"{path / fname}: tensor '{name}' has shape "
                                         f"{tuple(t.shape)}, config.json "
                                         f"implies {tuple(expected[name].shape)}")
                    state[name] = t.to(device=device, dtype=dtype)
        missing = [n for n in expected if n not in state]
        if missing:
            index = path / "model.safetensors.index.json"
            source = index if index.exists() else path / "model.safetensors"
            raise ValueError(f"{source}: missing tensor '{missing[0]}'"
                             + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.name_or_path = str(path)
        return model

    def save_pretrained(self, path, tokenizer_dir=None, max_shard_bytes=2 << 30):
        """config.json + model.safetensors (or shards + index above max_shard_bytes) + tokenizer
        files copied from tokenizer_dir (default: the directory this model was loaded from, if
        any)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dtype = next(self.parameters()).dtype
        cfg = {**self.cfg.to_hf(), "dtype": str(dtype).removeprefix("torch.")}
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        # named_parameters skips the tied lm_head (it is embed_tokens); safetensors refuses shared
        # storage anyway
        tensors = {n: p.detach().to("cpu").contiguous() for n, p in self.named_parameters()}
        shards, size = [{}], 0
        for n, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][n], size = t, size + nbytes
        for old in (list(path.glob("model*.safetensors"))
                    + list(path.glob("model.safetensors.index.json"))):
            old.unlink()  # stale shards from an earlier save would confuse loaders
        if len(shards) == 1:
            save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, path / fname, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        src = Path(tokenizer_dir or getattr(self, "name_or_path", None) or path)
        for fname in TOKENIZER_FILES:
            if (src / fname).exists() and (src / fname).resolve() != (path / fname).resolve():
                shutil.copy(src / fname, path / fname)
        return path
