"""Policy-gradient losses for LLM RL post-training: one nn.Module per paper, plus the small pure
functions around them (advantage estimators, KL estimators, off-policy corrections, DAPO's
reward shaping).

Every loss has the same call (torchforge's contract, extended with the behaviour policy):

    loss_fn = GRPOLoss(clip_low=0.2, clip_high=0.2, beta=0.04)
    loss, metrics = loss_fn(logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None)

    logprobs      (B, T)  log pi_theta(token) at the sampled tokens, requires grad         -> lp
    ref_logprobs  (B, T)  frozen reference model; None is fine when the loss has no KL term -> ref
    advantages    (B,) or (B, 1) one per sequence, or (B, T) one per token; detached       -> A
    padding_mask  (B, T)  1 on response tokens, 0 elsewhere                                 -> m
    old_logprobs  (B, T)  the behaviour policy that sampled the batch; None = on-policy    -> old
                          (old = sg(lp): the ratio is exactly 1 but still has d r / d lp = 1)
    loss          scalar to MINIMISE (minus the paper's objective)
    metrics       detached 0-d tensors "loss/pg", "loss/kl", "loss/clip_frac", ... (no .item(): a
                  device sync)

Notation: r = exp(lp - old), sg(.) = stop-gradient, l[i,t] the per-token loss, n_i = sum_t m[i,t],
N = sum n_i. Aggregating l is exactly where the papers disagree, so each loss writes its own as
w[i,t] = d loss / d l[i,t]:
    token-mean            w = m / N        every token weighs the same (DAPO, CISPO, torchforge
                                           REINFORCE)
    seq-mean-token-mean   w = m / (B n_i)  every sequence weighs the same, so a token of a short
                                           answer weighs more than one of a long answer (GRPO paper,
                                           GSPO, SAPO, SimpleGRPO)
    constant normaliser   w = m / (B C)    C a fixed token budget: no length bias at all (Dr.GRPO)
and loss = sum(w * l). A fully masked row has n_i clamped to 1: it adds 0, still counts in B
(torchforge/TRL).

Padding hygiene: each loss first overwrites the padding slots of lp/old/ref/A with 0 via torch.where
(not m*x, since 0 * inf = NaN), so junk there cannot reach the value and the gradient at padding is
exactly 0.

Train/inference mismatch and staleness: pass the trainer's old_logprobs and
A[:, None] * correction_weights(name, old, gen_logp, ...) as (B, T) advantages. Every loss here is
positively homogeneous in A per token (clip/gate patterns depend only on sign(A)), so this is
exactly weighting each token's loss by its correction weight.
Entropy bonus: add entropy_bonus(entropy, mask, coef) to the loss (entropy from
model.forward(return_entropy=True)).

Left out: critics/GAE; verl's [-20, 20] clamp on lp - old (an overflow at a real token is a
divergence to see, not hide); token counts across ranks (the trainer's job). Worked examples:
docs/losses-spec.md.
"""
import math

import torch
from torch import nn


def kl_estimate(logp, ref_logp, kind="k3"):
    """Per-token estimators of KL(pi || pi_ref), d = logp - ref_logp
    (http://joschu.net/blog/kl-approx.html):
        k1 = d                    unbiased, can be negative; grad 1
        k2 = d^2 / 2              biased, >= 0; grad d
        k3 = exp(-d) + d - 1      unbiased, >= 0 (DeepSeekMath eq. 4, verl "low_var_kl");
                                  grad 1 - exp(-d)"""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.expm1(-d) + d  # expm1: no cancellation when lp ~ ref, where k3 ~ d^2/2 is tiny
    raise ValueError(f"kl must be one of 'k1', 'k2', 'k3', got {kind!r}")


def _prepare(logprobs, ref_logprobs, advantages, padding_mask, old_logprobs,
             need_ref=False, who="loss"):
    """Plumbing shared by every loss -> m (float mask), lp, old, ref or None, A (B, T); all 0 at
    padding."""
    keep = padding_mask.bool()
    # where, not m*x: junk (even inf) at padding cannot become NaN
    lp = torch.where(keep, logprobs, 0.0)
    old = lp.detach() if old_logprobs is None else torch.where(keep, old_logprobs.detach(), 0.0)
    if need_ref and ref_logprobs is None:
        raise ValueError(f"{who} has beta > 0 and needs ref_logprobs (or set beta=0.0)")
    # ref is NOT detached: callers pass a frozen model's logprobs (torchforge's test expects ref to
    # get a grad)
    ref = None if ref_logprobs is None else torch.where(keep, ref_logprobs, 0.0)
    adv = advantages.detach().to(lp.dtype)
    adv = torch.where(keep, (adv[:, None] if adv.dim() == 1 else adv).expand_as(lp), 0.0)
    return keep.to(lp.dtype), lp, old, ref, adv


def masked_mean(x, m):  # masked mean over all real tokens, for metrics
    return ((x * m).sum() / m.sum().clamp(min=1)).detach()


class SimpleGRPOLoss(nn.Module):
    """SimpleGRPO, torchforge's `SimpleGRPOLoss`: on-policy GRPO, no clipping, k3 KL in the loss.

        l_t = -(exp(lp_t - sg(lp_t)) * A - beta * k3(lp_t, ref_t)),   loss = seq-mean-token-mean(l)

    The ratio is exactly 1 (value -A + beta*k3) with gradient 1:
    d l / d lp = -A + beta * (1 - exp(ref - lp)).
    Paper: DeepSeekMath (arXiv 2402.03300) eq. 3 in its single-update case, as coded in
    meta-pytorch/torchforge.
    vs GRPOLoss: equals GRPOLoss(kl="k3", agg="seq_mean_token_mean") with old = sg(lp), where no
    clip can fire.
    NOTE: it hard-codes on-policy, so `old_logprobs` is accepted for the common signature and
    IGNORED; use GRPOLoss for several updates per batch. beta=0.1 is torchforge's default (the
    paper's is 0.04).
    """

    def __init__(self, beta: float = 0.1):
        super().__init__()
        self.beta = beta

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, _, ref, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask, None,
                                      self.beta > 0, "SimpleGRPOLoss")
        ratio = torch.exp(lp - lp.detach())  # == 1, but d ratio / d lp == 1
        pg = -ratio * adv
        kl = kl_estimate(lp, ref, "k3") if ref is not None else torch.zeros_like(lp)
        w = m / (m.sum(-1, keepdim=True).clamp(min=1) * m.shape[0])  # seq-mean-token-mean
        loss = (w * (pg + self.beta * kl)).sum()
        return loss, {"loss/pg": (w * pg).sum().detach(), "loss/kl": (w * kl).sum().detach()}


class ReinforceLoss(nn.Module):
    """REINFORCE with a clamped, detached importance weight (torchforge's `ReinforceLoss`).

        w_t = clamp(sg(exp(lp_t - old_t)), is_min, is_max),   l_t = -w_t * A * lp_t,
        loss = token-mean(l)

    Gradient -w*A on EVERY token: the weight is detached and clamped, so a token far off-policy
    still learns (bounded), where PPO-clip would drop it. The value is -A*lp*w, a surrogate,
    not ~ -A. Paper: Williams 1992; the IS form is torchforge's (meta-pytorch/torchforge
    src/forge/losses/reinforce_loss.py).
    vs CISPOLoss: the same per-token form, but CISPO's weight is capped one-sided at 1 + eps_high
    only.
    """

    def __init__(self, is_min: float = 0.1, is_max: float = 10.0):
        super().__init__()
        self.is_min, self.is_max = is_min, is_max

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, old, _, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask,
                                      old_logprobs)
        ratio = torch.exp(lp - old).detach()
        pg = -ratio.clamp(self.is_min, self.is_max) * adv * lp  # detached, clamped IS weight
        w = m / m.sum().clamp(min=1)  # token-mean
        loss = (w * pg).sum()
        clipped = (ratio < self.is_min) | (ratio > self.is_max)
        return loss, {"loss/pg": loss.detach(),
                      "loss/clip_frac": masked_mean(clipped.to(m.dtype), m),
                      "loss/ratio_mean": masked_mean(ratio, m)}


class GRPOLoss(nn.Module):
    """GRPO: PPO-clip surrogate with a KL penalty inside the loss (DeepSeekMath, arXiv 2402.03300,
    eq. 3).

        l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A) + beta * k(lp_t, ref_t),
        r_t = exp(lp_t - old_t)
        loss = seq-mean-token-mean(l)   (the paper's 1/G sum_i 1/|o_i| sum_t)
               or agg="token_mean" (verl default)

    Zero pg-gradient exactly on {A > 0, r > 1 + clip_high} u {A < 0, r < 1 - clip_low}; all other
    tokens, in range or not, get -A*r. beta=0.04 and k3 are the paper's. dual_clip=c > 1 (verl, off
    by default, not in the paper) also caps l at -A*c when A < 0, zeroing the gradient of tokens
    with r > c.
    vs SimpleGRPOLoss: that is this with old = sg(lp). vs DAPOLoss: KL term, symmetric clip,
    per-sequence mean.
    """

    def __init__(self, clip_low=0.2, clip_high=0.2, beta=0.04, kl="k3", agg="seq_mean_token_mean",
                 dual_clip=None):
        super().__init__()
        if agg not in ("seq_mean_token_mean", "token_mean"):
            raise ValueError(f"agg must be 'seq_mean_token_mean' or 'token_mean', got {agg!r}")
        if dual_clip is not None and dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        if kl not in ("k1", "k2", "k3"):
            raise ValueError(f"kl must be one of 'k1', 'k2', 'k3', got {kl!r}")
        self.clip_low, self.clip_high, self.beta, self.kl, self.agg = (
            clip_low, clip_high, beta, kl, agg)
        self.dual_clip = dual_clip

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, old, ref, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask,
                                        old_logprobs, self.beta > 0, "GRPOLoss")
        ratio = torch.exp(lp - old)
        pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * adv)
        clipped = (((adv > 0) & (ratio > 1 + self.clip_high))
                   | ((adv < 0) & (ratio < 1 - self.clip_low)))
        if self.dual_clip is not None:  # lower-bound the objective of A < 0 tokens at c*A
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * self.dual_clip), pg)
        kl = kl_estimate(lp, ref, self.kl) if ref is not None else torch.zeros_like(lp)
        if self.agg == "token_mean":
            w = m / m.sum().clamp(min=1)
        # seq-mean-token-mean: mean over each row's tokens, then over rows (empty rows count in B)
        else:
            w = m / (m.sum(-1, keepdim=True).clamp(min=1) * m.shape[0])
        loss = (w * (pg + self.beta * kl)).sum()
        return loss, {"loss/pg": (w * pg).sum().detach(), "loss/kl": (w * kl).sum().detach(),
                      "loss/clip_frac": masked_mean(clipped.to(m.dtype), m),
                      "loss/ratio_mean": masked_mean(ratio, m)}


class DrGRPOLoss(nn.Module):
    """Dr.GRPO, "GRPO Done Right" (arXiv 2503.20783): GRPO's PPO-clip with a CONSTANT normaliser, no
    KL.

        l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A),
        loss = sum_{i,t} m l / (B * C)

    C = max_tokens, the generation budget, the same for every batch (the authors' oat code, TRL
    "dr_grpo"). Every token weighs 1/(B*C) whatever its sequence's length: GRPO's 1/n_i rewards
    short correct answers and excuses long wrong ones. Pair with dr_grpo_advantages (no std). vs
    GRPOLoss: same per-token loss with beta=0; only the normaliser differs (verl's variant also
    omits the /B).
    """

    def __init__(self, max_tokens: int, clip_low=0.2, clip_high=0.2):
        super().__init__()
        self.max_tokens, self.clip_low, self.clip_high = max_tokens, clip_low, clip_high

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, old, _, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask,
                                      old_logprobs)
        ratio = torch.exp(lp - old)
        pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * adv)
        clipped = (((adv > 0) & (ratio > 1 + self.clip_high))
                   | ((adv < 0) & (ratio < 1 - self.clip_low)))
        w = m / (m.shape[0] * self.max_tokens)  # constant normaliser: no length in the weight
        loss = (w * pg).sum()
        return loss, {"loss/pg": loss.detach(),
                      "loss/clip_frac": masked_mean(clipped.to(m.dtype), m),
                      "loss/ratio_mean": masked_mean(ratio, m)}


class DAPOLoss(nn.Module):
    """DAPO (arXiv 2503.14476, eqs. 8-12): PPO-clip with decoupled "Clip-Higher" bounds, token-mean,
    no KL.

        l_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A),
        loss = sum_{i,t} m l / sum_i n_i

    clip_high = 0.28 > clip_low = 0.2 lets low-probability tokens with A > 0 grow further before
    clipping (against entropy collapse). Token-level mean: long sequences get proportionally more
    weight. The rest of DAPO is outside the loss: zero_std_groups (dynamic sampling),
    overlong_penalty (reward).
    vs GRPOLoss: equals GRPOLoss(clip_high=0.28, beta=0, agg="token_mean").
    """

    def __init__(self, clip_low=0.2, clip_high=0.28):
        super().__init__()
        self.clip_low, self.clip_high = clip_low, clip_high

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, old, _, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask,
                                      old_logprobs)
        ratio = torch.exp(lp - old)
        pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * adv)
        clipped = (((adv > 0) & (ratio > 1 + self.clip_high))
                   | ((adv < 0) & (ratio < 1 - self.clip_low)))
        w = m / m.sum().clamp(min=1)  # token-mean over the whole batch
        loss = (w * pg).sum()
        return loss, {"loss/pg": loss.detach(),
                      "loss/clip_frac": masked_mean(clipped.to(m.dtype), m),
                      "loss/ratio_mean": masked_mean(ratio, m)}


class CISPOLoss(nn.Module):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5): clip the detached IS weight, never drop a
    token.

        r_hat_t = clip(sg(r_t), 1 - clip_low, 1 + clip_high),   l_t = -r_hat_t * A * lp_t,
        loss = token-mean(l)

    The gradient -r_hat*A reaches every token, clipped ones included (with the capped weight):
    PPO-clip drops the rare high-ratio "fork" tokens that matter for long reasoning. clip_low=None
    (no lower bound) as in the paper. NOTE: MiniMax do not disclose their eps_high; 4.0 (cap 5.0) is
    ScaleRL/TRL's value.
    vs ReinforceLoss: same surrogate; the weight is capped only above (verl's two-sided:
    clip_low=0.2, clip_high=0.2).
    """

    def __init__(self, clip_high=4.0, clip_low=None):
        super().__init__()
        self.clip_high, self.clip_low = clip_high, clip_low

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, old, _, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask,
                                      old_logprobs)
        ratio = torch.exp(lp - old).detach()
        low = None if self.clip_low is None else 1 - self.clip_low
        pg = -ratio.clamp(min=low, max=1 + self.clip_high) * adv * lp
        clipped = (ratio > 1 + self.clip_high) | (ratio < (0.0 if low is None else low))
        w = m / m.sum().clamp(min=1)  # token-mean
        loss = (w * pg).sum()
        return loss, {"loss/pg": loss.detach(),
                      "loss/clip_frac": masked_mean(clipped.to(m.dtype), m),
                      "loss/ratio_mean": masked_mean(ratio, m)}


class GSPOLoss(nn.Module):
    """GSPO (Qwen, arXiv 2507.18071, eqs. 5-7 and 13-14): one length-normalised ratio per sequence.

        s_i = (pi(y_i) / pi_old(y_i))^(1/n_i) = exp(sum_t m (lp - old) / n_i)
        level="sequence":  loss = -1/B sum_i min(s_i A_i,
                                                 clip(s_i, 1 - clip_low, 1 + clip_high) A_i)
        level="token":     s_it = sg(s_i) exp(lp_t - sg(lp_t)),
                           loss = seq-mean-token-mean(-min(s_it A_t, clip(s_it) A_t))

    A clipped sequence loses the gradient of ALL its tokens; others give each token -A_i
    s_i / (B n_i). GSPO-token equals GSPO for per-sequence A (the paper's claim, tested) and also
    takes per-token A (e.g. folded-in token TIS weights), which level="sequence" averages over the
    row. Clip range 3e-4 / 4e-4 (section 5.1): s_i is a geometric mean of token ratios, so it stays
    near 1.
    vs GRPOLoss: the ratio and the clip decision are per sequence, not per token; no KL.
    """

    def __init__(self, clip_low=3e-4, clip_high=4e-4, level="sequence"):
        super().__init__()
        if level not in ("sequence", "token"):
            raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
        self.clip_low, self.clip_high, self.level = clip_low, clip_high, level

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, old, _, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask,
                                      old_logprobs)
        n = m.sum(-1).clamp(min=1)
        # (B,) masked mean log-ratio: padding never enters
        s = torch.exp(((lp - old) * m).sum(-1) / n)
        lo, hi = 1 - self.clip_low, 1 + self.clip_high
        if self.level == "sequence":
            # A_i; a (B, T) A is averaged over the row (per-token A: level="token")
            a = (adv * m).sum(-1) / n
            seq = torch.maximum(-s * a, -s.clamp(lo, hi) * a)  # an empty row has a = 0: it adds 0
            loss = seq.sum() / m.shape[0]
            clipped = (((a > 0) & (s > hi)) | ((a < 0) & (s < lo)))[:, None]  # the whole row's fate
        else:
            s_tok = s.detach()[:, None] * torch.exp(lp - lp.detach())  # value s_i, gradient of lp_t
            pg = torch.maximum(-s_tok * adv, -s_tok.clamp(lo, hi) * adv)
            w = m / (n[:, None] * m.shape[0])  # seq-mean-token-mean
            loss = (w * pg).sum()
            clipped = ((adv > 0) & (s_tok > hi)) | ((adv < 0) & (s_tok < lo))
        return loss, {"loss/pg": loss.detach(),
                      "loss/clip_frac": masked_mean(clipped.to(m.dtype), m),
                      "loss/ratio_mean": masked_mean(s[:, None], m)}


class SAPOLoss(nn.Module):
    """SAPO (Qwen, arXiv 2511.20347): a smooth sigmoid gate instead of a hard clip.

        f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau,  tau = tau_pos if A > 0 else tau_neg
        l_t = -f(r_t; tau_t) A,   loss = seq-mean-token-mean(l)

    d l / d lp = -A * 4 sig (1 - sig) r: equal to GRPO's -A on-policy (f'(1) = 1), decaying smoothly
    as r leaves 1 but never exactly 0. The on-policy VALUE is -(2/tau) A, not -A.
    tau_neg = 1.05 > tau_pos makes negative-advantage tokens decay faster (the paper's most stable
    setting). vs GRPOLoss: no hard clip, no KL.
    """

    def __init__(self, tau_pos=1.0, tau_neg=1.05):
        super().__init__()
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def forward(self, logprobs, ref_logprobs, advantages, padding_mask, old_logprobs=None):
        m, lp, old, _, adv = _prepare(logprobs, ref_logprobs, advantages, padding_mask,
                                      old_logprobs)
        ratio = torch.exp(lp - old)
        # in lp's dtype, not fp32
        tau = torch.full_like(adv, self.tau_neg).masked_fill(adv > 0, self.tau_pos)
        gate = torch.sigmoid(tau * (ratio - 1))
        pg = -gate * (4 / tau) * adv
        w = m / (m.sum(-1, keepdim=True).clamp(min=1) * m.shape[0])  # seq-mean-token-mean
        loss = (w * pg).sum()
        return loss, {"loss/pg": loss.detach(), "loss/ratio_mean": masked_mean(ratio, m),
                      "loss/gate_grad_mean": masked_mean(4 * gate * (1 - gate), m)}  # 1 on-policy


LOSSES = {"grpo": GRPOLoss, "dr_grpo": DrGRPOLoss, "dapo": DAPOLoss, "cispo": CISPOLoss,
          "gspo": GSPOLoss, "sapo": SAPOLoss, "simple_grpo": SimpleGRPOLoss,
          "reinforce": ReinforceLoss}


# ---- advantage estimators: rewards (B prompts, G samples each) -> advantages, no grad ------------
# Each is called as fn(rewards, batch) and returns (B, G), one advantage per sequence, or (B*G, T),
# one per token, where batch is the update's token batch (batch["mask"] is (B*G, T): 1 on trained
# tokens; also ids, gen_logp, and teacher_logp under distill.teacher). The four below are
# sequence-level and ignore it; a per-token one (a process reward, a teacher's logprobs) reads it.
# `loss.adv` names one: a key of ADVANTAGES or a user's "file.py:fn". An estimator that takes `eps`
# gets loss.adv_eps.

def _as_float(x):
    x = torch.as_tensor(x)
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _centred(r):
    """R - mean_g R, exactly 0 for all-equal groups (the float mean of [0.7]*6 is not exactly
    0.7)."""
    same = (r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True))
    return torch.where(same, 0.0, r - r.mean(-1, keepdim=True))


def group_advantages(rewards, batch=None, eps=1e-6):
    """GRPO (DeepSeekMath section 4.1.2): A = (R - mean_g R) / (std_g R + eps) within each prompt's
    group. std is unbiased (ddof=1) as in verl/TRL/torchforge; eps=1e-6 is verl's (TRL/torchforge
    use 1e-4). A group of size 1 has nothing to compare against: its advantage is 0 (verl's
    convention)."""
    r = _as_float(rewards)
    return torch.zeros_like(r) if r.shape[-1] < 2 else _centred(r) / (r.std(-1, keepdim=True) + eps)


def dr_grpo_advantages(rewards, batch=None):
    """Dr.GRPO: A = R - mean_g R. Dividing by std up-weights near-unanimous (too easy / too hard)
    groups."""
    return _centred(_as_float(rewards))


def rloo_advantages(rewards, batch=None):
    """RLOO (arXiv 2402.14740): baseline = mean of the OTHER G-1 samples, A = G/(G-1)
    (R - mean_g R).
    Unbiased: the baseline does not depend on the sample it scores. Group of size 1: 0."""
    r, g = _as_float(rewards), rewards.shape[-1]
    return torch.zeros_like(r) if g < 2 else g / (g - 1) * _centred(r)


def reinforce_pp_advantages(rewards, batch=None, eps=1e-8, group_baseline=False):
    """REINFORCE++ (arXiv 2501.03262v1, eqs. 4-8): whiten over the WHOLE batch, not per group:
    A = (R - mean_batch) / (std_batch + eps), ddof=1; group_baseline=True (verl's
    "REINFORCE++-baseline") subtracts each group's mean first. NOTE: sequence-level; per-token
    KL-in-reward returns are the caller's."""
    r = _as_float(rewards)
    if group_baseline:
        r = r - r.mean(-1, keepdim=True)
    return torch.zeros_like(r) if r.numel() < 2 else (r - r.mean()) / (r.std() + eps)


ADVANTAGES = {"grpo": group_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages,
              "reinforce_pp": reinforce_pp_advantages}


def distill_advantages(teacher_logp, gen_logp, mask, coef=1.0):
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu & Thinking Machines Lab 2025): the
    student samples, a frozen teacher scores each sampled token, and the advantage of token t is
        A_t = coef * (log pi_teacher(y_t | y_<t) - log pi_gen(y_t | y_<t)),   0 off the mask,
    the per-token sampled estimate of -coef * reverse KL(pi_gen || pi_teacher), with discount 0 (no
    sum over later tokens) and no group baseline. Summed over a sequence its expectation is
    -coef * KL over sequences (docs/losses-spec.md, section 1). pi_gen is the sampler's own
    logprobs (batch["gen_logp"]), as the method defines it. (B*G, T), no grad."""
    keep = mask.bool()
    return coef * torch.where(keep, teacher_logp - gen_logp, 0.0).detach()


def zero_std_groups(rewards):
    """DAPO dynamic sampling: (P,) bool, True for groups whose rewards are all equal (all right or
    all wrong). Their advantages are all 0 so they carry no gradient; DAPO drops them and samples
    more prompts."""
    r = torch.as_tensor(rewards)
    return r.amax(-1) == r.amin(-1)


def overlong_penalty(lengths, max_len, cache_len):
    """DAPO soft overlong punishment (eq. 13), ADDED to the correctness reward, with L = response
    length:
        0 if L <= max_len - cache_len;  (max_len - cache_len - L) / cache_len up to max_len;
        -1 beyond."""
    L = _as_float(lengths)
    soft = max_len - cache_len
    return torch.where(L <= soft, 0.0,
                       torch.where(L <= max_len, (soft - L) / cache_len, -1.0)).to(L.dtype)


# ---- off-policy corrections: the policy that sampled (the generator's logprobs, gen) is not the
# one the loss treats as behaviour (old: the trainer's score of it; sg(lp) on-policy): numerics
# (bf16, kernels) and staleness (the generator ran k versions behind) both open the gap. Each rule
# maps d = log rho = old - gen (B, T), 0 on padding, to a weight per token; the trainer multiplies
# the advantages by it (the losses are positively homogeneous in A, so this weights each token's
# loss; masked tokens still count in the loss's normaliser). C = loss.correction_c. Worked
# examples: docs/losses-spec.md section 13. On-policy with exact numerics (d = 0) each is 1.

def tis(d, mask, c):
    """Truncated IS, token level (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"):  w_t = min(rho_t, C)."""
    return torch.exp(d.clamp(max=math.log(c)))  # capped in log space: exp may overflow first


def seq_tis(d, mask, c):
    """Truncated IS, sequence level:  w_i = min(prod_t rho_t, C) on every token of sequence i."""
    return torch.exp(d.sum(-1, keepdim=True).clamp(max=math.log(c))).expand_as(d)


def icepop(d, mask, c):
    """IcePop (Ling Team 2025, Ring-1T): a token whose two policies disagree beyond a band is
    dropped rather than capped:  w_t = rho_t if 1/C <= rho_t <= C, else 0."""
    keep = d.abs() <= math.log(c)
    return torch.where(keep, torch.exp(d.clamp(max=math.log(c))), 0.0)


def seq_mis(d, mask, c):
    """Masked IS, sequence level (Liu, Li et al. 2025, "When Speed Kills Stability"): a sequence
    whose IS ratio exceeds C is rejected:  w_i = rho_i if rho_i = prod_t rho_t <= C, else 0."""
    s = d.sum(-1, keepdim=True)
    return torch.where(s <= math.log(c), torch.exp(s.clamp(max=math.log(c))), 0.0).expand_as(d)


def geo_mask(d, mask, c):
    """Geometric-mean rejection (same source, part 3): sequence i is kept with weight 1 iff its
    per-token geometric mean ratio (prod_t rho_t)^(1/n_i) lies in [1/C, C], else dropped (0); no
    reweighting. The mean does not grow with length, so C is tight (e.g. 1.001)."""
    g = d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return (g.abs() <= math.log(c)).to(d.dtype).expand_as(d)


CORRECTIONS = {"tis": tis, "seq_tis": seq_tis, "icepop": icepop, "seq_mis": seq_mis,
               "geo_mask": geo_mask}


def correction_weights(rule, old_logp, gen_logp, mask, c):
    """The weights of `rule`, a key of CORRECTIONS or a function with their call (d, mask, c) ->
    (B, T) (loss.correction = "file.py:fn"): detached, 0 on padding, (B, T). Use: loss_fn(lp, ref,
    A * w, mask, old_logprobs=old_logp)."""
    if isinstance(rule, str):
        if rule not in CORRECTIONS:
            raise ValueError(f"correction must be one of {sorted(CORRECTIONS)}, got {rule!r}")
        rule = CORRECTIONS[rule]
    keep = mask.bool()
    d = torch.where(keep, (old_logp - gen_logp).detach(), 0.0)
    return torch.where(keep, rule(d, mask, c).detach(), 0.0)


def entropy_bonus(entropy, mask, coef):
    """Term to ADD to the loss for an entropy bonus: -coef * token-mean(entropy) over response
    tokens (minimising it raises entropy). entropy (B, T) from model.forward(...,
    return_entropy=True)."""
    return -coef * torch.where(mask.bool(), entropy, 0.0).sum() / mask.sum().clamp(min=1)
