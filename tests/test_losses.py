"""Tests for losses.py against docs/losses-spec.md.

Oracles: the spec's worked examples E1-E10 (numbers copied verbatim; value and autograd gradient,
float64, atol 1e-6), the invariants of its section 10 on seeded random inputs, and a slow per-token
Python-loop reference for every loss (scalar autograd ops, no vectorisation, no padding tricks).
"""
import inspect
import math

import pytest
import torch

import losses
from conftest import BUILTIN_LOSSES
from losses import (LOSSES, CISPOLoss, DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss, ReinforceLoss, SAPOLoss,
                    SimpleGRPOLoss, distill_advantages, dr_grpo_advantages, entropy_bonus,
                    group_advantages,
                    kl_estimate, overlong_penalty, reinforce_pp_advantages, rloo_advantages,
                    correction_weights, zero_std_groups)

D = torch.float64
ATOL = 1e-6


def t(x):
    return torch.tensor(x, dtype=D)


# ---- spec fixture F (B=2, T=3; slot [1,2] is padding filled with junk on purpose) ----
M = t([[1, 1, 1], [1, 1, 0]])
LP = t([[-1.0, -0.5, -2.0], [-0.3, -1.2, -5.0]])
OLD = t([[-1.1, -0.4, -2.3], [-0.5, -0.9, -1.0]])
REF = t([[-1.2, -0.6, -1.8], [-0.4, -1.0, -2.0]])
ADV = t([1.0, -0.5])


def run(loss_fn, lp=LP, ref=REF, adv=ADV, mask=M, old=OLD):
    """-> (loss value, d loss / d lp, metrics) via autograd."""
    lp = lp.clone().requires_grad_(True)
    loss, metrics = loss_fn(lp, ref, adv, mask, old_logprobs=old)
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), torch.zeros_like(lp) if grad is None else grad, metrics


def close(x, y, atol=ATOL):
    return torch.allclose(torch.as_tensor(x, dtype=D), torch.as_tensor(y, dtype=D), atol=atol, rtol=0)


def with_(x, idx, v):
    x = x.clone()
    x[idx] = v
    return x


# ---- worked examples: (id, loss, kwargs for run, loss value, full grad or {index: value}) ----
E1A_G = [[-0.163646, -0.165081, -0.170357], [0.127379, 0.119465, 0]]
E1B_G = [[-1 / 6, -1 / 6, -1 / 6], [0.125, 0.125, 0]]
E2A_G = [[-0.221034, -0.180967, -0.269972], [0.122140, 0.074082, 0]]
O5 = with_(with_(OLD, (0, 2), -2.25), (0, 0), -1.23)
EXAMPLES = [
    ("E1a", SimpleGRPOLoss(beta=0.1), {}, -0.248594, E1A_G),
    ("E1b", SimpleGRPOLoss(beta=0.0), {}, -0.250000, E1B_G),
    ("E1c", SimpleGRPOLoss(), dict(lp=t([[0.0]]), ref=t([[0.0]]), adv=t([[1.0]]), mask=t([[1.0]]), old=None),
     -1.0, [[-1.0]]),
    # row 2 fully masked: it adds 0 but still counts in B, so row 0's gradient is E1a's
    ("E1d", SimpleGRPOLoss(beta=0.1), dict(mask=t([[1, 1, 1], [0, 0, 0]])), -0.499250, [E1A_G[0], [0, 0, 0]]),
    ("E2a", ReinforceLoss(), {}, 0.725921, E2A_G),
    ("E2b", ReinforceLoss(), dict(old=LP), 0.550000, [[-0.2, -0.2, -0.2], [0.1, 0.1, 0]]),
    ("E2c", ReinforceLoss(), dict(old=with_(OLD, (0, 2), -6.0)), 4.185978,
     [E2A_G[0][:2] + [-2.0], E2A_G[1]]),
    ("E3a", GRPOLoss(0.2, 0.2, 0.04), {}, -0.281764, [[-0.182987, -0.150172, -0.001476], [0.153627, -0.002214, 0]]),
    ("E3b", GRPOLoss(0.2, 0.2, 0.04, agg="token_mean"), {}, -0.439292,
     [[-0.219584, -0.180206, -0.001771], [0.122902, -0.001771, 0]]),
    ("E3c", GRPOLoss(beta=0.0), dict(old=LP), -0.250000, E1B_G),
    ("E3d-nodual", GRPOLoss(beta=0.0, agg="token_mean"), dict(old=with_(OLD, (1, 0), -2.3)), 0.176904,
     {(1, 0): 0.738906}),
    ("E3d-dual3", GRPOLoss(beta=0.0, agg="token_mean", dual_clip=3.0), dict(old=with_(OLD, (1, 0), -2.3)),
     -0.262002, {(1, 0): 0.0}),
    ("E4", DrGRPOLoss(max_tokens=4), {}, -0.274913, [[-0.138146, -0.113105, 0], [0.076338, 0, 0]]),
    ("E5a", DAPOLoss(), {}, -0.455861, [[-0.221034, -0.180967, 0], [0.122140, 0, 0]]),
    ("E5b-0.20", DAPOLoss(clip_high=0.2), dict(old=O5), -0.458827, {(0, 0): 0.0}),
    ("E5b-0.28", DAPOLoss(clip_high=0.28), dict(old=O5), -0.486547, {(0, 0): -0.251720, (0, 2): 0.0}),
    ("E6a", CISPOLoss(clip_high=0.28), {}, 0.697978, [[-0.221034, -0.180967, -0.256000], [0.122140, 0.074082, 0]]),
    ("E6b", CISPOLoss(clip_high=0.2, clip_low=0.2), {}, 0.659518, [[-0.221034, -0.180967, -0.24], [0.12, 0.08, 0]]),
    ("E6c", CISPOLoss(clip_high=4.0), {}, 0.725921, E2A_G),
    ("E8a", SAPOLoss(), {}, -0.587843, [[-0.183687, -0.150465, -0.218230], [0.150631, 0.090909, 0]]),
    ("E8b", SAPOLoss(), dict(old=LP), -0.523810, E1B_G),
]
E7 = [("E7a", [[3e-4, -1e-4, 4e-4], [2e-4, -6e-4, 0.7]], [1.0002, 0.9998], -0.250150,
       [[-0.166700, -0.166700, -0.166700], [0.124975, 0.124975, 0]]),
      ("E7b", [[9e-4, 3e-4, 6e-4], [-5e-4, -5e-4, 0.7]], [1.0006, 0.9995], -0.250275, [[0, 0, 0], [0, 0, 0]]),
      ("E7c", (LP - OLD).tolist(), [math.exp(0.1), math.exp(-0.05)], -0.250275, [[0, 0, 0], [0, 0, 0]])]


@pytest.mark.parametrize("name,loss_fn,kw,value,grad", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_worked_example(name, loss_fn, kw, value, grad):
    loss, g, _ = run(loss_fn, **kw)
    assert close(loss, value), (name, loss.item(), value)
    if isinstance(grad, dict):
        for idx, v in grad.items():
            assert close(g[idx], v), (name, idx, g[idx].item(), v)
    else:
        assert close(g, grad), (name, g.tolist(), grad)
    if g.shape == M.shape and kw.get("mask") is None:
        assert g[1, 2] == 0  # the padding slot gets exactly zero gradient


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("name,d,s,value,grad", E7, ids=[e[0] for e in E7])
def test_worked_example_gspo(level, name, d, s, value, grad):
    loss, g, metrics = run(GSPOLoss(level=level), old=LP - t(d))
    assert close(loss, value) and close(g, grad), (name, loss.item(), g.tolist())
    n = M.sum(-1)
    if name == "E7a":  # unclipped: grad = -A_i s_i / (B n_i) on every token, so s_i can be read back
        assert close(-g[:, 0] * 2 * n / ADV, s)
    else:              # clipped: every token of both sequences loses its gradient
        assert metrics["loss/clip_frac"] == 1.0
    # the token-weighted mean sequence ratio reported as a metric
    assert close(metrics["loss/ratio_mean"], (t(s) * n).sum() / n.sum())


def test_grpo_clip_frac_on_fixture():
    # F's clipped tokens are exactly [0,2] (A>0, r>1.2) and [1,1] (A<0, r<0.8); [1,0] is outside the range but kept
    _, g, metrics = run(GRPOLoss(beta=0.0))
    assert close(metrics["loss/clip_frac"], 2 / 5)
    assert g[0, 2] == 0 and g[1, 1] == 0 and g[1, 0] != 0


def test_e3_in_float32():
    loss, g, _ = run(GRPOLoss(), lp=LP.float(), ref=REF.float(), adv=ADV.float(), mask=M.float(), old=OLD.float())
    assert loss.dtype == torch.float32
    assert close(loss, -0.281764, 1e-5) and close(g, [[-0.182987, -0.150172, -0.001476], [0.153627, -0.002214, 0]], 1e-5)


# ---- E9: advantage estimators and DAPO's reward shaping ----

def test_e9_advantages():
    r = t([[1, 0, 0, 1, 0, 0]])
    assert close(group_advantages(r, eps=1e-6), [[1.290992, -0.645496, -0.645496, 1.290992, -0.645496, -0.645496]])
    assert close(dr_grpo_advantages(r),
                 [[0.666667, -0.333333, -0.333333, 0.666667, -0.333333, -0.333333]])
    assert close(rloo_advantages(r), [[0.8, -0.4, -0.4, 0.8, -0.4, -0.4]])
    for f in (group_advantages, dr_grpo_advantages, rloo_advantages):
        assert torch.equal(f(t([[0.7] * 6])), torch.zeros(1, 6, dtype=D))  # all-equal group
    rb = t([[1, 0, 0, 1], [1, 1, 1, 0]])
    assert close(reinforce_pp_advantages(rb), [[0.724569, -1.207615, -1.207615, 0.724569],
                                               [0.724569, 0.724569, 0.724569, -1.207615]])


def test_advantage_properties():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 2, (6, 5), generator=g).to(D) + 0.1 * torch.randn(6, 5, generator=g, dtype=D)
    for f in (group_advantages, dr_grpo_advantages, rloo_advantages):
        assert close(f(r).sum(-1), torch.zeros(6), 1e-12)  # zero-sum within every group
    loo = torch.stack([r[:, i] - torch.cat([r[:, :i], r[:, i + 1:]], 1).mean(1) for i in range(5)], 1)
    assert close(rloo_advantages(r), loo, 1e-12)
    assert close(group_advantages(r, eps=0.0), (r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True), 1e-12)
    assert close(group_advantages(r, eps=1e-4) * (r.std(1, keepdim=True) + 1e-4),
                 r - r.mean(1, keepdim=True), 1e-12)  # eps is a parameter
    for f in (group_advantages, rloo_advantages, dr_grpo_advantages):
        assert torch.equal(f(t([[3.0], [1.0]])), torch.zeros(2, 1, dtype=D))  # group of size 1: advantage 0
    assert torch.equal(reinforce_pp_advantages(t([[3.0]])), torch.zeros(1, 1, dtype=D))
    a = reinforce_pp_advantages(r)
    assert close(a.mean(), 0, 1e-12) and close(a.std(), 1, 1e-6)  # whitened over the whole batch
    b = reinforce_pp_advantages(r, group_baseline=True)
    c = r - r.mean(1, keepdim=True)
    assert close(b, (c - c.mean()) / c.std(), 1e-6)
    assert group_advantages(torch.tensor([[1, 0]])).dtype.is_floating_point  # int rewards are fine


def test_e10_distillation_advantages_and_a_slow_loop():
    a = distill_advantages(t([[-0.5, -1.0, -2.0]]), t([[-0.7, -0.9, -2.0]]), t([[1, 1, 0]]),
                           coef=2.0)
    assert close(a, [[0.4, -0.2, 0.0]]) and close(-a.sum() / 2, -0.1)
    lp, old, _, _, mask = rand_batch(3)  # junk past each row's end: 0 there, never NaN
    slow = [[2.0 * (float(lp[i, j]) - float(old[i, j])) if mask[i, j] else 0.0
             for j in range(lp.shape[1])] for i in range(lp.shape[0])]
    assert close(distill_advantages(lp, old, mask, coef=2.0), slow, 1e-12)


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_teacher_equal_to_the_student_gives_exactly_zero_gradient(name):
    """On-policy distillation with teacher = sampler: A = 0 on every token, and every loss's
    gradient is exactly 0 (beta = 0; the same numbers on both sides, so no mismatch)."""
    lp, old, _, _, mask = rand_batch(4)
    adv = distill_advantages(lp, lp, mask)
    assert torch.equal(adv, torch.zeros_like(lp))
    kw = dict(REQUIRED.get(name, {}))
    if "beta" in inspect.signature(LOSSES[name]).parameters:
        kw["beta"] = 0.0
    _, grad, _ = run(LOSSES[name](**kw), lp, None, adv, mask, lp.detach())
    assert torch.equal(grad, torch.zeros_like(lp)), name


def test_zero_std_groups_and_overlong():
    r = t([[1, 1, 1], [0, 1, 0], [0, 0, 0], [-1, -1, -1.0]])
    assert zero_std_groups(r).tolist() == [True, False, True, True]
    p = overlong_penalty(torch.tensor([100, 16384, 18432, 20480, 20481]), max_len=20480, cache_len=4096)
    assert close(p, [0.0, 0.0, -0.5, -1.0, -1.0])


# docs/losses-spec.md section 13: old = F's lp (the trainer's score of the behaviour policy), gen =
# F's old (the generator's), so rho = F's r; C = 1.2 (geo_mask also at 1.1)
E13 = {"tis": [[1.105171, 0.904837, 1.2], [1.2, 0.740818, 0]],
       "seq_tis": [[1.2, 1.2, 1.2], [0.904837, 0.904837, 0]],
       "icepop": [[1.105171, 0.904837, 0], [0, 0, 0]],
       "seq_mis": [[0, 0, 0], [0.904837, 0.904837, 0]],
       "geo_mask": [[1, 1, 1], [1, 1, 0]]}


@pytest.mark.parametrize("name", sorted(E13))
def test_correction_worked_examples(name):
    assert close(correction_weights(name, LP, OLD, M, 1.2), E13[name])
    assert close(correction_weights(name, LP, LP, M, 1.2), M)  # on-policy, exact numerics: w = 1
    lpg = LP.clone().requires_grad_(True)
    assert not correction_weights(name, lpg, OLD, M, 1.2).requires_grad  # detached


def test_geo_mask_tight_threshold_and_no_overflow():
    # row means of log rho: 0.1 and -0.05 -> at C = 1.1 row 0 (1.105) is out, row 1 (0.951) in
    assert close(correction_weights("geo_mask", LP, OLD, M, 1.1), [[0, 0, 0], [1, 1, 0]])
    big, zero, ones = t([[500.0, 500.0]]), t([[0.0, 0.0]]), t([[1, 1]])
    for name, want in (("tis", [[2.0, 2.0]]), ("seq_tis", [[2.0, 2.0]]), ("icepop", [[0, 0]]),
                       ("seq_mis", [[0, 0]]), ("geo_mask", [[0, 0]])):
        assert close(correction_weights(name, big, zero, ones, 2.0), want), name  # no inf/NaN


def loop_correction(name, old, gen, mask, c):
    """Slow reference: plain floats, one sequence and one token at a time."""
    out = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        toks = [j for j in range(mask.shape[1]) if mask[i, j] > 0]
        rho = {j: math.exp(float(old[i, j]) - float(gen[i, j])) for j in toks}
        seq = math.prod(rho.values())
        geo = seq ** (1 / len(toks)) if toks else 1.0
        for j in toks:
            out[i, j] = {"tis": min(rho[j], c), "seq_tis": min(seq, c),
                         "icepop": rho[j] if 1 / c <= rho[j] <= c else 0.0,
                         "seq_mis": seq if seq <= c else 0.0,
                         "geo_mask": 1.0 if 1 / c <= geo <= c else 0.0}[name]
    return out


@pytest.mark.parametrize("name", sorted(losses.CORRECTIONS))
def test_corrections_match_a_slow_loop_off_policy(name):
    # a constructed off-policy batch: gen drawn 0.3 nats around old, junk in the padding
    for seed in range(3):
        _, old, _, _, mask = rand_batch(seed)
        g = torch.Generator().manual_seed(100 + seed)
        noise = 0.3 * torch.randn(old.shape, generator=g, dtype=D)
        gen = torch.where(mask.bool(), old + noise, 77.0)
        for c in (1.05, 1.5, 4.0):
            w = correction_weights(name, old, gen, mask, c)
            assert close(w, loop_correction(name, old, gen, mask, c), 1e-9), (seed, c)
        assert 0 < float(w.sum()) and bool((w[~mask.bool()] == 0).all())


def test_correction_takes_a_user_rule_and_refuses_unknown_names():
    half = lambda d, mask, c: torch.full_like(d, 0.5)  # noqa: E731  (a user's rule: any function)
    assert close(correction_weights(half, LP, OLD, M, 2.0), 0.5 * M)
    with pytest.raises(ValueError, match="icepop"):
        correction_weights("ice_pop", LP, OLD, M, 2.0)


def test_correction_folds_into_per_token_advantages():
    # loss(A * w) == sum_t w_t * l_t / N for a token-mean loss: l_t read off single-token masks
    lp, old, ref, adv, mask = rand_batch(3)
    g = torch.Generator().manual_seed(1)
    w = correction_weights("tis", old + 0.1 * torch.randn(old.shape, dtype=D, generator=g), old,
                           mask, 1.2)
    loss_w, _, _ = run(DAPOLoss(), lp, None, adv[:, None] * w, mask, old)
    total = 0.0
    for i, j in mask.nonzero().tolist():
        one = torch.zeros_like(mask)
        one[i, j] = 1
        total += w[i, j] * run(DAPOLoss(), lp, None, adv, one, old)[0]
    assert close(loss_w, total / mask.sum(), 1e-12)


# ---- slow per-token Python-loop references (scalar autograd ops, one token at a time) ----

def _a(adv, i, j):
    return float(adv[i]) if adv.dim() == 1 else float(adv[i, 0] if adv.shape[1] == 1 else adv[i, j])


def _kl(d, kind):
    return {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[kind]


def loop_ppo(lp, ref, adv, mask, old, el=0.2, eh=0.2, beta=0.0, kl="k3", agg="seq", C=None, dual=None):
    B, T = lp.shape
    n = [int(mask[i].sum()) for i in range(B)]
    total = lp.new_zeros(())
    for i in range(B):
        for j in range(T):
            if mask[i, j] == 0:
                continue
            a, r = _a(adv, i, j), torch.exp(lp[i, j] - old[i, j])
            rc = 1 + eh if r.item() > 1 + eh else (1 - el if r.item() < 1 - el else r)
            l = -(r * a if (r * a).item() <= rc * a else rc * a + 0 * r)  # min() of the two branches
            if dual is not None and a < 0 and l.item() > -a * dual:
                l = 0 * r - a * dual
            if beta:
                l = l + beta * _kl(lp[i, j] - ref[i, j], kl)
            norm = {"seq": B * n[i], "tok": sum(n), "const": B * (C or 1)}[agg]
            total = total + l / norm
    return total


def loop_reinforce(lp, ref, adv, mask, old, lo=0.1, hi=10.0):
    total, N = lp.new_zeros(()), int(mask.sum())
    for i, j in mask.nonzero().tolist():
        w = min(max(math.exp(lp[i, j].item() - old[i, j].item()), lo), hi)
        total = total - lp[i, j] * _a(adv, i, j) * w / N
    return total


def loop_cispo(lp, ref, adv, mask, old, eh=4.0, el=None):
    total, N = lp.new_zeros(()), int(mask.sum())
    for i, j in mask.nonzero().tolist():
        w = min(math.exp(lp[i, j].item() - old[i, j].item()), 1 + eh)
        w = w if el is None else max(w, 1 - el)
        total = total - w * _a(adv, i, j) * lp[i, j] / N
    return total


def loop_gspo(lp, ref, adv, mask, old, el=3e-4, eh=4e-4):
    B, T = lp.shape
    total = lp.new_zeros(())
    for i in range(B):
        toks = [j for j in range(T) if mask[i, j] != 0]
        if not toks:
            continue
        s = torch.exp(sum(lp[i, j] - old[i, j] for j in toks) / len(toks))
        a = _a(adv, i, 0)
        sc = 1 + eh if s.item() > 1 + eh else (1 - el if s.item() < 1 - el else s)
        total = total - (s * a if (s * a).item() <= sc * a else sc * a + 0 * s) / B
    return total


def loop_sapo(lp, ref, adv, mask, old, tp=1.0, tn=1.05):
    B, T = lp.shape
    total = lp.new_zeros(())
    for i in range(B):
        n = int(mask[i].sum())
        for j in range(T):
            if mask[i, j] != 0:
                a = _a(adv, i, j)
                tau = tp if a > 0 else tn
                r = torch.exp(lp[i, j] - old[i, j])
                total = total - 1 / (1 + torch.exp(-tau * (r - 1))) * 4 / tau * a / (B * n)
    return total


def loop_simple(lp, ref, adv, mask, old, beta=0.1):
    return loop_ppo(lp, ref, adv, mask, lp.detach(), el=math.inf, eh=math.inf, beta=beta)


CASES = {  # name -> (module, loop reference, needs per-sequence A)
    "simple_grpo": (SimpleGRPOLoss(0.1), loop_simple, False),
    "reinforce": (ReinforceLoss(), loop_reinforce, False),
    "grpo": (GRPOLoss(), lambda *x: loop_ppo(*x, beta=0.04), False),
    "grpo_tok_k1_dual": (GRPOLoss(0.1, 0.3, 0.02, kl="k1", agg="token_mean", dual_clip=1.5),
                         lambda *x: loop_ppo(*x, el=0.1, eh=0.3, beta=0.02, kl="k1", agg="tok", dual=1.5), False),
    "grpo_k2": (GRPOLoss(beta=0.3, kl="k2"), lambda *x: loop_ppo(*x, beta=0.3, kl="k2"), False),
    "dr_grpo": (DrGRPOLoss(9), lambda *x: loop_ppo(*x, agg="const", C=9), False),
    "dapo": (DAPOLoss(), lambda *x: loop_ppo(*x, eh=0.28, agg="tok"), False),
    "cispo": (CISPOLoss(0.28), lambda *x: loop_cispo(*x, eh=0.28), False),
    "cispo_2side": (CISPOLoss(0.2, 0.2), lambda *x: loop_cispo(*x, eh=0.2, el=0.2), False),
    "gspo": (GSPOLoss(0.03, 0.04), lambda *x: loop_gspo(*x, el=0.03, eh=0.04), True),
    "gspo_token": (GSPOLoss(0.03, 0.04, level="token"), lambda *x: loop_gspo(*x, el=0.03, eh=0.04), True),
    "sapo": (SAPOLoss(), loop_sapo, False),
}


def rand_batch(seed, B=6, T=7, spread=0.3):
    """Random batch with rows of varied length, one fully masked row, and junk in the padding."""
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(B, T, generator=g, dtype=D) - 0.05
    old = lp + spread * torch.randn(B, T, generator=g, dtype=D)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, generator=g, dtype=D)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[-1] = T, 0
    mask = (torch.arange(T)[None] < lengths[:, None]).to(D)
    junk = 100 * torch.randn(B, T, generator=g, dtype=D)
    return [torch.where(mask.bool(), x, junk) for x in (lp, old, ref)] + [adv, mask]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_matches_python_loop_reference(name, seed, per_token_adv):
    loss_fn, loop, per_seq = CASES[name]
    lp, old, ref, adv, mask = rand_batch(seed, spread=0.03 if "gspo" in name else 0.3)
    if per_token_adv:
        if not per_seq:
            adv = adv[:, None] * torch.rand(lp.shape, dtype=D, generator=torch.Generator().manual_seed(seed)) * 2
        else:  # GSPO: the trainer's broadcast (B, T) copy of per-sequence A, junk at padding
            adv = torch.where(mask.bool(), adv[:, None], 7.0)
    loss, g, _ = run(loss_fn, lp, ref, adv, mask, old)
    lp_ref = lp.clone().requires_grad_(True)
    expect = loop(lp_ref, ref, adv, mask, old)
    (g_ref,) = torch.autograd.grad(expect, lp_ref, allow_unused=True)
    g_ref = torch.zeros_like(lp) if g_ref is None else g_ref
    assert close(loss, expect.detach(), 1e-10) and close(g, g_ref, 1e-10), name
    assert (g != 0).any() or name.startswith("gspo")


# ---- section 10 invariants on random inputs ----

# arguments with no default (or a test's)
REQUIRED = {"dr_grpo": {"max_tokens": 7}, "simple_grpo": {"beta": 0.1}}


def all_losses():
    """Every losses.LOSSES entry (a loss added there is tested here too, with its defaults), plus
    variants."""
    return {**{name: cls(**REQUIRED.get(name, {})) for name, cls in LOSSES.items()},
            "grpo_tok": GRPOLoss(agg="token_mean", dual_clip=2.0, kl="k2"),
            "gspo_token": GSPOLoss(level="token")}


@pytest.mark.parametrize("name", list(all_losses()))
def test_padding_changes_nothing(name):
    # 1. junk (huge, inf, NaN) at m = 0 slots of lp/old/ref/A: same loss, same metrics, exactly 0 gradient there
    loss_fn = all_losses()[name]
    lp, old, ref, adv, mask = rand_batch(5)
    a2 = adv[:, None].expand_as(lp).clone()
    base = run(loss_fn, lp, ref, a2, mask, old)
    pad = ~mask.bool()
    junk = t([1e30, -math.inf, math.inf, math.nan, -1e4, 50.0]).repeat(20)[: int(pad.sum())]
    lp2, old2, ref2 = (x.clone().index_put_((pad,), junk.roll(k)) for k, x in enumerate((lp, old, ref)))
    a3 = a2.clone().index_put_((pad,), junk.roll(3))
    out = run(loss_fn, lp2, ref2, a3, mask, old2)
    assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1]), name
    assert torch.isfinite(out[0]) and torch.isfinite(out[1]).all()
    assert (out[1][pad] == 0).all()
    for k in base[2]:
        assert torch.equal(base[2][k], out[2][k]), k
    assert (out[1][-1] == 0).all()  # the fully masked row


def expected_weights(mask, agg, C=None):
    B, n = mask.shape[0], mask.sum(-1, keepdim=True).clamp(min=1)
    return {"seq": mask / (B * n), "tok": mask / mask.sum(), "const": mask / (B * C)}[agg]


ON_POLICY = {  # beta = 0; (module, aggregation, on-policy value per token as a function of A, tau and lp)
    "simple_grpo": (SimpleGRPOLoss(0.0), "seq", lambda a, lp: -a),
    "grpo": (GRPOLoss(beta=0.0), "seq", lambda a, lp: -a),
    "grpo_tok": (GRPOLoss(beta=0.0, agg="token_mean"), "tok", lambda a, lp: -a),
    "dr_grpo": (DrGRPOLoss(7), "const", lambda a, lp: -a),
    "dapo": (DAPOLoss(), "tok", lambda a, lp: -a),
    "cispo": (CISPOLoss(), "tok", lambda a, lp: -a * lp),
    "reinforce": (ReinforceLoss(), "tok", lambda a, lp: -a * lp),
    "gspo": (GSPOLoss(), "seq", lambda a, lp: -a),
    "gspo_token": (GSPOLoss(level="token"), "seq", lambda a, lp: -a),
    "sapo": (SAPOLoss(), "seq", lambda a, lp: -a * 2 / torch.where(a > 0, t(1.0), t(1.05))),
}


@pytest.mark.parametrize("name", list(ON_POLICY))
@pytest.mark.parametrize("explicit_old", [False, True])
def test_on_policy_equivalence(name, explicit_old):
    # 2. old = sg(lp), beta = 0: every loss's gradient is -A_i * W_it for its aggregation W
    loss_fn, agg, value = ON_POLICY[name]
    lp, _, ref, adv, mask = rand_batch(7)
    loss, g, _ = run(loss_fn, lp, None, adv, mask, lp.detach() if explicit_old else None)
    W = expected_weights(mask, agg, C=7)
    A = adv[:, None].expand_as(lp)
    assert close(g, -A * W, 1e-12), name
    assert close(loss, (W * value(A, torch.where(mask.bool(), lp, 0.0))).sum(), 1e-12), name


def test_simple_grpo_equals_grpo_with_sg_old():
    # 3. SimpleGRPO(beta) == GRPO(old = sg(lp), k3, beta, seq-mean-token-mean), any clip range
    for seed, beta, eps in [(0, 0.1, 0.2), (1, 0.04, 0.01), (2, 0.5, 10.0)]:
        lp, old, ref, adv, mask = rand_batch(seed)
        a = run(SimpleGRPOLoss(beta), lp, ref, adv, mask, old)  # old is ignored by SimpleGRPO
        b = run(GRPOLoss(eps, eps, beta), lp, ref, adv, mask, None)
        assert close(a[0], b[0], 1e-12) and close(a[1], b[1], 1e-12)
        assert close(a[2]["loss/kl"], b[2]["loss/kl"], 1e-12)
        # property (c): with beta = 0 the value does not depend on lp
        assert close(run(SimpleGRPOLoss(0.0), lp, ref, adv, mask)[0], run(SimpleGRPOLoss(0.0), lp - 1, ref, adv, mask)[0])


@pytest.mark.parametrize("loss_fn,agg,el,eh", [(GRPOLoss(beta=0.0), "seq", 0.2, 0.2),
                                               (GRPOLoss(0.1, 0.3, beta=0.0, agg="token_mean"), "tok", 0.1, 0.3),
                                               (DAPOLoss(), "tok", 0.2, 0.28), (DrGRPOLoss(7), "const", 0.2, 0.2)])
def test_clip_zero_gradient_set(loss_fn, agg, el, eh):
    # 4. zero gradient exactly on {A>0, r>1+eh} u {A<0, r<1-el}; every other token (even out of range) has -A r W
    lp, old, ref, adv, mask = rand_batch(11, B=8, T=9, spread=0.4)
    _, g, metrics = run(loss_fn, lp, None, adv, mask, old)
    A, r, real = adv[:, None].expand_as(lp), torch.exp(lp - old), mask.bool()
    dead = real & (((A > 0) & (r > 1 + eh)) | ((A < 0) & (r < 1 - el)))
    kept_out_of_range = real & ~dead & ((r > 1 + eh) | (r < 1 - el))
    assert dead.any() and kept_out_of_range.any()  # the fixture exercises both cases
    assert (g[dead] == 0).all()
    live = real & ~dead
    assert close(g[live], (-A * r * expected_weights(mask, agg, C=7))[live], 1e-12)
    assert (g[live] != 0).all()
    assert close(metrics["loss/clip_frac"], dead.sum().item() / real.sum().item(), 1e-12)


def test_dual_clip_zero_gradient_set():
    lp, old, ref, adv, mask = rand_batch(12, B=8, T=9, spread=0.8)
    _, g, _ = run(GRPOLoss(beta=0.0, agg="token_mean", dual_clip=1.5), lp, None, adv, mask, old)
    A, r, real = adv[:, None].expand_as(lp), torch.exp(lp - old), mask.bool()
    dual = real & (A < 0) & (r > 1.5)
    dead = real & (((A > 0) & (r > 1.2)) | ((A < 0) & (r < 0.8)) | dual)
    assert dual.any() and (g[dead] == 0).all()
    assert close(g[real & ~dead], (-A * r / mask.sum())[real & ~dead], 1e-12)


def test_cispo_gradient_flows_through_clipped_tokens():
    # 5. CISPO grad = -sg(clip(r)) A W on every token, nonzero where clipped; cap = inf is the IS policy gradient
    lp, old, ref, adv, mask = rand_batch(13, spread=0.5)
    A, r, real = adv[:, None].expand_as(lp), torch.exp(lp - old), mask.bool()
    _, g, m = run(CISPOLoss(clip_high=0.2), lp, None, adv, mask, old)
    clipped = real & (r > 1.2)
    assert clipped.any() and (g[clipped] != 0).all()
    assert close(g, torch.where(real, -r.clamp(max=1.2) * A / mask.sum(), 0.0), 1e-12)
    assert close(m["loss/clip_frac"], clipped.sum().item() / real.sum().item(), 1e-12)
    _, g_inf, _ = run(CISPOLoss(clip_high=math.inf), lp, None, adv, mask, old)
    assert close(g_inf, torch.where(real, -r * A / mask.sum(), 0.0), 1e-12)


def test_gspo_sequence_equals_token_and_ratio_is_masked_geometric_mean():
    # 6. GSPO == GSPO-token; s_i = exp(masked mean(lp - old)), invariant to permuting a row's tokens
    for seed in range(4):
        lp, old, ref, adv, mask = rand_batch(seed, spread=1e-3)
        a = run(GSPOLoss(), lp, None, adv, mask, old)
        b = run(GSPOLoss(level="token"), lp, None, adv, mask, old)
        assert close(a[0], b[0], 1e-12) and close(a[1], b[1], 1e-12)
        assert torch.equal(a[2]["loss/clip_frac"], b[2]["loss/clip_frac"])
    lp, old, ref, adv, mask = rand_batch(3, spread=1e-3)
    perm = torch.stack([torch.randperm(7, generator=torch.Generator().manual_seed(i)) for i in range(6)])
    pl, po, pm = (x.gather(1, perm) for x in (lp, old, mask))
    a, b = run(GSPOLoss(), lp, None, adv, mask, old), run(GSPOLoss(), pl, None, adv, pm, po)
    assert close(a[0], b[0], 1e-12) and close(a[1].gather(1, perm), b[1], 1e-12)
    # every token of a sequence gets the same weight; a clipped sequence gets none
    g, real = a[1], mask.bool()
    for i in range(6):
        vals = g[i][real[i]]
        assert vals.numel() == 0 or close(vals, vals[0].expand_as(vals), 1e-15)


def test_gspo_sequence_level_averages_per_token_advantages():
    lp, old, ref, adv, mask = rand_batch(6, spread=1e-3)
    a_tok = adv[:, None] * (0.5 + torch.rand(lp.shape, dtype=D, generator=torch.Generator().manual_seed(0)))
    row_mean = (a_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    a, b = run(GSPOLoss(), lp, None, a_tok, mask, old), run(GSPOLoss(), lp, None, row_mean, mask, old)
    assert close(a[0], b[0], 1e-12) and close(a[1], b[1], 1e-12)


def test_kl_estimators():
    # 7. k3, k2 >= 0; k1 can be < 0; all 0 at lp = ref with zero k2/k3 gradient; d k3 / d lp = 1 - exp(ref - lp)
    g = torch.Generator().manual_seed(0)
    lp = (-3 * torch.rand(50, generator=g, dtype=D)).requires_grad_(True)
    ref = -3 * torch.rand(50, generator=g, dtype=D)
    k1, k2, k3 = (kl_estimate(lp, ref, k) for k in ("k1", "k2", "k3"))
    assert (k2 >= 0).all() and (k3 >= 0).all() and (k1 < 0).any()
    assert close(k3, torch.exp(ref - lp) - (ref - lp) - 1, 1e-12)
    (gk3,) = torch.autograd.grad(k3.sum(), lp)
    assert close(gk3, 1 - torch.exp(ref - lp), 1e-12)
    x = ref.clone().requires_grad_(True)
    for k in ("k1", "k2", "k3"):
        v = kl_estimate(x, ref, k)
        assert (v == 0).all()
        (gx,) = torch.autograd.grad(v.sum(), x)
        assert (gx == (1.0 if k == "k1" else 0.0)).all()
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


def test_aggregations_coincide_when_lengths_equal():
    # 8. all n_i = T (and C = T): seq-mean-token-mean == token-mean == constant normaliser
    lp, old, ref, adv, _ = rand_batch(4)
    mask = torch.ones_like(lp)
    outs = [run(f, lp, None, adv, mask, old) for f in
            (GRPOLoss(beta=0.0), GRPOLoss(beta=0.0, agg="token_mean"), DrGRPOLoss(max_tokens=7))]
    for o in outs[1:]:
        assert close(o[0], outs[0][0], 1e-12) and close(o[1], outs[0][1], 1e-12)
    assert not close(run(GRPOLoss())[0], run(GRPOLoss(agg="token_mean"))[0])  # E3a != E3b on F


@pytest.mark.parametrize("name", list(all_losses()))
def test_positively_homogeneous_in_advantage(name):
    # 9. with the clip/gate pattern fixed (it depends only on sign(A)), loss and grad scale with A (beta = 0)
    loss_fn = {"simple_grpo": SimpleGRPOLoss(0.0), "grpo": GRPOLoss(beta=0.0),
               "grpo_tok": GRPOLoss(beta=0.0, agg="token_mean", dual_clip=2.0)}.get(name, all_losses()[name])
    lp, old, ref, adv, mask = rand_batch(8, spread=0.3 if "gspo" not in name else 1e-3)
    a, b = run(loss_fn, lp, None, adv, mask, old), run(loss_fn, lp, None, 2.5 * adv, mask, old)
    assert close(b[0], 2.5 * a[0], 1e-12) and close(b[1], 2.5 * a[1], 1e-12)


# ---- contract details ----

@pytest.mark.parametrize("name", list(all_losses()))
def test_fully_masked_rows_and_batches_are_finite(name):
    loss_fn = all_losses()[name]
    lp, old, ref, adv, mask = rand_batch(9)
    for m in (mask, torch.zeros_like(mask)):
        loss, g, metrics = run(loss_fn, lp, ref, adv, m, old)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(torch.isfinite(v) for v in metrics.values())
    assert loss == 0 and (g == 0).all()  # nothing to learn from an empty batch


@pytest.mark.parametrize("name", list(all_losses()))
def test_metrics_are_detached_scalars(name):
    lp, old, ref, adv, mask = rand_batch(10)
    lp = lp.requires_grad_(True)
    loss, metrics = all_losses()[name](lp, ref, adv, mask, old)
    assert loss.dim() == 0 and loss.requires_grad
    assert "loss/pg" in metrics
    for k, v in metrics.items():
        assert k.startswith("loss/") and isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_ref_logprobs_none_and_beta():
    lp, old, ref, adv, mask = rand_batch(2)
    for name, cls in LOSSES.items():
        kw = {"max_tokens": 7} if name == "dr_grpo" else ({"beta": 0.0} if name in ("grpo", "simple_grpo") else {})
        run(cls(**kw), lp, None, adv, mask, old)  # no KL term: ref may be None
    for loss_fn in (GRPOLoss(beta=0.04), SimpleGRPOLoss(beta=0.1)):
        with pytest.raises(ValueError, match="ref_logprobs"):
            run(loss_fn, lp, None, adv, mask, old)
    # with beta = 0 a given ref only feeds the KL metric, not the loss
    a, b = run(GRPOLoss(beta=0.0), lp, ref, adv, mask, old), run(GRPOLoss(beta=0.0), lp, None, adv, mask, old)
    assert torch.equal(a[0], b[0]) and a[2]["loss/kl"] > 0 and b[2]["loss/kl"] == 0


def test_simple_grpo_ref_receives_gradient():
    # spec 2(d), torchforge's own test: ref is not detached inside the loss (callers pass a detached ref)
    ref = REF.clone().requires_grad_(True)
    loss, _ = SimpleGRPOLoss(0.1)(LP.clone().requires_grad_(True), ref, ADV, M)
    loss.backward()
    assert ref.grad is not None and (ref.grad[M.bool()] != 0).all() and ref.grad[1, 2] == 0


def test_advantage_shapes_are_equivalent():
    for loss_fn in all_losses().values():
        a = run(loss_fn, adv=ADV)
        b = run(loss_fn, adv=ADV[:, None])
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        c = run(loss_fn, adv=ADV[:, None].expand(2, 3).clone())
        assert close(a[0], c[0], 1e-15) and close(a[1], c[1], 1e-15)


def test_constructor_validation_and_registry():
    assert set(BUILTIN_LOSSES) <= set(LOSSES)  # a fork may add losses; the built-ins stay
    assert LOSSES["grpo"] is GRPOLoss and LOSSES["dr_grpo"] is DrGRPOLoss
    g = GRPOLoss()
    assert (g.clip_low, g.clip_high, g.beta, g.kl, g.agg, g.dual_clip) == (0.2, 0.2, 0.04, "k3", "seq_mean_token_mean", None)
    assert (DAPOLoss().clip_low, DAPOLoss().clip_high) == (0.2, 0.28)
    assert (CISPOLoss().clip_high, CISPOLoss().clip_low) == (4.0, None)
    assert (GSPOLoss().clip_low, GSPOLoss().clip_high) == (3e-4, 4e-4)
    assert (SAPOLoss().tau_pos, SAPOLoss().tau_neg) == (1.0, 1.05)
    assert SimpleGRPOLoss().beta == 0.1 and (ReinforceLoss().is_min, ReinforceLoss().is_max) == (0.1, 10.0)
    for bad in (dict(agg="seq_sum"), dict(kl="k4"), dict(dual_clip=1.0)):
        with pytest.raises(ValueError):
            GRPOLoss(**bad)
    with pytest.raises(ValueError):
        GSPOLoss(level="tok")
    with pytest.raises(ValueError):
        correction_weights("seq", LP, OLD, M, 2.0)


def test_entropy_bonus():
    ent = t([[1.0, 2.0, 3.0], [0.5, 0.5, math.nan]])
    assert close(entropy_bonus(ent, M, 0.01), -0.01 * 7.0 / 5)
    assert entropy_bonus(ent, torch.zeros_like(M), 0.01) == 0
    e = ent.nan_to_num().requires_grad_(True)
    entropy_bonus(e, M, 0.1).backward()
    assert close(e.grad, -0.1 * M / 5)


def test_each_builtin_loss_stands_alone_in_under_100_lines():
    # STYLE.md: each loss reads on its own in well under 100 lines (a style rule for the built-ins,
    # not a file cap)
    import inspect
    for name in BUILTIN_LOSSES:
        assert len(inspect.getsource(LOSSES[name]).splitlines()) < 100, name


def test_advantage_registry_and_per_token_shapes():
    """losses.ADVANTAGES: one name per estimator, called as fn(rewards, batch); sequence-level ones
    return (B, G) and ignore the batch."""
    assert set(losses.ADVANTAGES) == ({"grpo", "dr_grpo", "rloo", "reinforce_pp"}
                                      | set(losses.ADVANTAGES))
    r = t([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.0]])
    batch = {"mask": torch.ones(8, 5)}
    for name, fn in losses.ADVANTAGES.items():
        assert torch.equal(fn(r, batch), fn(r)) and fn(r).shape == r.shape, name
