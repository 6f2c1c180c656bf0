"""model.py against its oracles: transformers' own Llama/Qwen2/Qwen3 (logits, both load/save directions), vLLM's
prompt logprobs, slow reference computations (padding, KV cache, logprobs, gradients), and the allocator's view of
peak memory for the chunked logprob head."""
import functools
import itertools
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvcache
from kvcache import KVCache
from model import ModelConfig, Transformer, chunked_logprobs

V = 96
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # small L, so all three frequency bands occur at head_dim 16
# (family, tied, num_attention_heads, num_key_value_heads, extra config) -- GQA ratios 1, 2 and 4 across families
CASES = [
    ("llama", False, 4, 1, {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    ("llama", True, 4, 4, {"rope_scaling": LLAMA3_ROPE}),
    ("qwen2", True, 4, 2, {}),
    ("qwen2", False, 4, 4, {}),
    ("qwen3", True, 4, 2, {"head_dim": 32}),  # head_dim decoupled from hidden_size / heads (4 * 32 != 64)
    ("qwen3", False, 4, 1, {"head_dim": 24}),
]
IDS = [f"{c[0]}-{'tied' if c[1] else 'untied'}-gqa{c[2] // c[3]}" for c in CASES]


def hf_model(family, tied, heads, kv_heads, extra, seed=0):
    """A random tiny transformers model; every parameter (biases and norm weights too) is perturbed so that
    a missing bias or norm in model.py would show."""
    import transformers
    cfg_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    cfg = getattr(transformers, cfg_cls)(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                                         max_position_embeddings=256, tie_word_embeddings=tied, rms_norm_eps=1e-5,
                                         **{k: (dict(v) if isinstance(v, dict) else v) for k, v in extra.items()})
    torch.manual_seed(seed)
    m = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return m


def our_model(family="qwen3", tied=True, heads=4, kv_heads=2, head_dim=32, seed=0, layers=2):
    cfg = ModelConfig(model_type=family, vocab_size=V, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                      rope_scaling=dict(LLAMA3_ROPE) if family == "llama" else None, max_position_embeddings=256,
                      tie_word_embeddings=tied, attention_bias=family == "qwen2", qk_norm=family == "qwen3")
    torch.manual_seed(seed)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return m


def rand_ids(B, T, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_logits_match_transformers_both_directions(case, tmp_path):
    family, tied, heads, kv_heads, extra = case
    hf = hf_model(*case)
    ids = rand_ids(2, 48)  # 48 > original_max_position_embeddings of the llama3 scaling
    with torch.no_grad():
        ref = hf(ids).logits
    hf.save_pretrained(tmp_path / "hf")  # transformers writes -> we read
    ours = Transformer.from_pretrained(tmp_path / "hf").eval()
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert set(ours.state_dict()) == set(hf.state_dict())  # exactly the Hugging Face names
    with torch.no_grad():
        err = (ours(ids) - ref).abs().max().item()
    print(f"parity {family} tied={tied} gqa={heads // kv_heads}: max|dlogits| = {err:.2e}")
    assert err <= 1e-4
    ours.save_pretrained(tmp_path / "ours")  # we write -> transformers reads
    from transformers import AutoModelForCausalLM
    hf2 = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(hf2) is type(hf)
    with torch.no_grad():
        assert (hf2(ids).logits - ref).abs().max().item() <= 1e-4


def test_hub_config_dialect_equals_transformers5_dialect():
    # Llama 3.1 and Qwen2.5 as found on the Hub: rope_theta / rope_scaling at top level ("type" or "rope_type")
    hub = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    v5 = {k: v for k, v in hub.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**hub["rope_scaling"], "rope_theta": 500000.0}
    a, b = ModelConfig.from_hf(hub), ModelConfig.from_hf(v5)
    assert a == b and a.head_dim == 128 and a.rope_scaling["factor"] == 8.0 and not a.qk_norm
    legacy = dict(hub, rope_scaling={**{k: v for k, v in hub["rope_scaling"].items() if k != "rope_type"},
                                     "type": "llama3"})
    assert ModelConfig.from_hf(legacy) == a
    qwen25 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_scaling": None,
              "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768}
    q = ModelConfig.from_hf(qwen25)
    assert q.attention_bias and q.rope_scaling is None and q.head_dim == 64 and q.rope_theta == 1e6
    assert ModelConfig.from_hf(q.to_hf()) == q and ModelConfig.from_hf(a.to_hf()) == a


@pytest.mark.parametrize("max_shard_bytes", [2 << 30, 40_000], ids=["single", "sharded"])
def test_save_load_round_trip_bit_exact(tmp_path, max_shard_bytes):
    m = our_model("qwen2", tied=True)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text('{"eos_token": "<e>"}')
    m.save_pretrained(tmp_path / "ckpt", tokenizer_dir=tok, max_shard_bytes=max_shard_bytes)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "tokenizer_config.json" in files and "config.json" in files
    if max_shard_bytes < 1 << 20:
        assert "model.safetensors.index.json" in files and "model-00002-of-" in " ".join(files)
    else:
        assert "model.safetensors" in files
        assert "lm_head.weight" not in load_file(tmp_path / "ckpt" / "model.safetensors")  # tied: not written
    m2 = Transformer.from_pretrained(tmp_path / "ckpt")
    assert m2.cfg == m.cfg and m2.lm_head.weight is m2.model.embed_tokens.weight
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    m2.save_pretrained(tmp_path / "again")  # a loaded model carries its tokenizer files along by default
    assert (tmp_path / "again" / "tokenizer_config.json").exists()
    bf = Transformer.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert bf.model.norm.weight.dtype == torch.bfloat16 and bf(rand_ids(1, 5)).dtype == torch.bfloat16


def test_bad_input_errors_name_field_tensor_and_file(tmp_path):
    m = our_model("llama", tied=False)
    ckpt = m.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())

    def load_with(**changes):
        (ckpt / "config.json").write_text(json.dumps({**cfg, **changes}))
        return Transformer.from_pretrained(ckpt)

    with pytest.raises(ValueError, match=r"config\.json.*unsupported model_type 'mistral'"):
        load_with(model_type="mistral")
    with pytest.raises(ValueError, match=r"config\.json.*missing config field 'intermediate_size'"):
        load_with(intermediate_size=None)
    with pytest.raises(ValueError, match=r"model\.safetensors.*'model\.layers\.0\.mlp\.\w+_proj\.weight'.*shape"):
        load_with(intermediate_size=128)
    with pytest.raises(ValueError, match=r"rope type 'yarn'"):
        load_with(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    (ckpt / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors.*missing tensor 'lm_head\.weight'"):
        Transformer.from_pretrained(ckpt)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_padding_invariance(family):
    m = our_model(family, kv_heads=1)
    lens = [11, 4, 8]
    seqs = [rand_ids(1, n, seed=i)[0] for i, n in enumerate(lens)]
    with torch.no_grad():
        alone = [m(s[None])[0] for s in seqs]
        for side in ("left", "right"):
            ids = torch.zeros(3, 11, dtype=torch.long)
            mask = torch.zeros(3, 11, dtype=torch.long)
            for i, s in enumerate(seqs):
                sl = slice(11 - len(s), 11) if side == "left" else slice(0, len(s))
                ids[i, sl], mask[i, sl] = s, 1
            out = m(ids, attention_mask=mask)
            for i, s in enumerate(seqs):
                sl = slice(11 - len(s), 11) if side == "left" else slice(0, len(s))
                assert (out[i, sl] - alone[i]).abs().max().item() < 1e-5, (side, i)


def test_packed_documents_equal_separate_sequences():
    m = our_model("qwen3")
    a, b = rand_ids(1, 7, seed=3), rand_ids(1, 5, seed=4)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        packed = m(torch.cat([a, b], 1), position_ids=pos)
        assert (packed[:, :7] - m(a)).abs().max() < 1e-5 and (packed[:, 7:] - m(b)).abs().max() < 1e-5


@pytest.mark.parametrize("family,kv_heads,dtype", [("llama", 1, torch.float32), ("qwen2", 1, torch.float32),
                                                    ("qwen3", 1, torch.float32), ("llama", 2, torch.bfloat16),
                                                    ("qwen3", 2, torch.bfloat16)])
def test_kv_cache_prefill_then_decode_matches_full_forward(family, kv_heads, dtype):
    """A decode step folds each KV head's query heads into its rows (KVCache.attend), where the full forward runs
    SDPA with enable_gqa (in fp32 for bf16 weights): the same logits, in bf16 up to its rounding (0.023 of ~3; a
    wrong grouping is off by ~3)."""
    m = our_model(family, kv_heads=kv_heads).to(dtype)
    ids = rand_ids(2, 20)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0  # left-padded second row
    with torch.no_grad():
        full = m(ids, attention_mask=mask)
        cache = KVCache(m.cfg, 2, 32, dtype, "cpu")
        outs = [m(ids[:, :12], attention_mask=mask[:, :12], kv_cache=cache, cache_pos=0)]
        for p in range(12, 20):
            outs.append(m(ids[:, p:p + 1], attention_mask=mask[:, :p + 1], kv_cache=cache, cache_pos=p))
    err = (torch.cat(outs, 1) - full).float()[mask.bool()].abs().max().item()
    assert err <= (1e-5 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("family,kv_heads,dtype", [("llama", 1, torch.float32), ("qwen3", 2, torch.float32),
                                                    ("qwen2", 2, torch.bfloat16)])
def test_shared_prefix_decode_matches_each_sequence_alone(family, kv_heads, dtype, fold, monkeypatch):
    """The torch generator's layout (KVCache.share_prefix): 2 left-padded prompts prefilled once, 3 rows each that
    cache only their own tokens, and rows 1 and 3 leaving the batch halfway (KVCache.keep). Every decode step's
    logits must equal the full forward of that row's prompt + tokens alone, on both of KVCache.attend's paths (a
    prompt's rows folded, CPU's; each row's prompt gathered, a GPU's)."""
    monkeypatch.setattr(kvcache.KVCache, "attend", functools.partialmethod(kvcache.KVCache.attend, fold=fold))
    m = our_model(family, kv_heads=kv_heads).to(dtype)
    lens, n, P, T = [12, 7], 3, 12, 6
    prompts, gen = rand_ids(2, P, seed=3), rand_ids(6, T, seed=4)
    pmask = torch.zeros(2, P, dtype=torch.long)
    for i, k in enumerate(lens):
        pmask[i, P - k:] = 1
    with torch.no_grad():
        pre = KVCache(m.cfg, 2, P, dtype, "cpu")
        m(prompts, attention_mask=pmask, kv_cache=pre, cache_pos=0)
        cache = KVCache(m.cfg, 6, T, dtype, "cpu")
        cache.share_prefix(pre, pmask, n)
        pos = pmask.sum(-1).repeat_interleave(n)
        got = torch.full((6, T, m.cfg.vocab_size), float("nan"))
        for t in range(T):
            if t == 3:
                cache.keep(torch.tensor([0, 2, 4, 5]))
            rows = cache.live
            ones = torch.ones(len(rows), t + 1, dtype=torch.long) if t % 2 else None  # no mask: the generator's
            got[rows, t] = m(gen[rows, t:t + 1], position_ids=(pos[rows] + t)[:, None], attention_mask=ones,
                             kv_cache=cache, cache_pos=t)[:, -1].float()
        for r in range(6):
            i = r // n
            alone = m(torch.cat([prompts[i, P - lens[i]:], gen[r]])[None])[0, lens[i]:].float()
            steps = T if r not in (1, 3) else 3
            err = (got[r, :steps] - alone[:steps]).abs().max().item()
            assert err <= (1e-5 if dtype == torch.float32 else 0.1), (r, err)
            assert got[r, steps:].isnan().all()  # a row that left was never computed again


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_grads_match_naive(temperature):
    m = our_model("qwen2", tied=True)
    ids = rand_ids(3, 17)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    targets = rand_ids(3, 17, seed=9)
    logits = m(ids, attention_mask=mask)
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    ref_logp = logp_all.gather(-1, targets[..., None])[..., 0]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ((ref_logp * mask).sum() + 0.3 * ref_ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    logp, ent = m(ids, attention_mask=mask, targets=targets, temperature=temperature, return_entropy=True,
                  logits_chunk=5)  # 51 tokens -> 11 chunks, the last one short
    assert logp.dtype == torch.float32 and logp.shape == (3, 17)
    assert (logp - ref_logp).abs().max() < 1e-5 and (ent - ref_ent).abs().max() < 1e-5
    ((logp * mask).sum() + 0.3 * ent.sum()).backward()
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n
    with torch.no_grad():
        assert torch.equal(m(ids, attention_mask=mask, targets=targets, temperature=temperature, logits_chunk=5),
                           logp.detach())
    # logp alone under autograd (SFT's path): model.ChunkLogp's backward without the entropy term
    m.zero_grad()
    logits = m(ids, attention_mask=mask)
    (torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])[..., 0] * mask).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    (m(ids, attention_mask=mask, targets=targets, temperature=temperature, logits_chunk=5) * mask).sum().backward()
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n
    m.zero_grad()  # the entropy computed but only logged (train_grpo's default): its backward is skipped
    logp, ent = m(ids, attention_mask=mask, targets=targets, temperature=temperature, return_entropy=True,
                  logits_chunk=5)
    (logp * mask).sum().backward()
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_shared_prefix_equals_full_batch_logprobs_and_grads(family):
    """GRPO rows = (prompt, completion): 3 prompts of different lengths (left-padded), a group of 3, 1 and 2 rows,
    completions of different lengths (right-padded). The shared-prefix forward must give the padded full batch's
    logprobs, entropies and parameter gradients."""
    m = our_model(family, kv_heads=2, layers=3)
    prompts = [rand_ids(1, n, seed=10 + i)[0] for i, n in enumerate([9, 4, 6])]
    rows = torch.tensor([0, 0, 0, 1, 2, 2])
    comps = [rand_ids(1, n, seed=20 + b)[0] for b, n in enumerate([5, 7, 2, 7, 1, 6])]
    P, R = 9, 7
    ids, attn = torch.zeros(6, P + R, dtype=torch.long), torch.zeros(6, P + R, dtype=torch.long)
    for b, (u, c) in enumerate(zip(rows.tolist(), comps)):
        ids[b, P - len(prompts[u]):P], ids[b, P:P + len(c)] = prompts[u], c
        attn[b, P - len(prompts[u]):P + len(c)] = 1
    resp = attn[:, P:].float()
    first = [rows.tolist().index(u) for u in range(3)]  # a row of each prompt holds its tokens

    def loss_and_grads(logp, ent):
        (-(logp * resp).sum() + 0.3 * (ent * resp).sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        return logp.detach(), ent.detach(), grads
    # full batch: the response logprobs are the outputs at columns P-1 .. P+R-2
    full = m(ids[:, :-1], attention_mask=attn[:, :-1], targets=ids[:, 1:], return_entropy=True)
    ref = loss_and_grads(full[0][:, P - 1:], full[1][:, P - 1:])
    # shared: each prompt once (all but its last token), every row from its last prompt token on
    out = m(ids[:, P - 1:-1], attention_mask=attn[:, :-1], targets=ids[:, P:], return_entropy=True,
            prefix=(ids[first, :P - 1], attn[first, :P - 1], rows))
    got = loss_and_grads(*out)
    mask = resp.bool()
    assert (got[0] - ref[0])[mask].abs().max() < 1e-5 and (got[1] - ref[1])[mask].abs().max() < 1e-5
    for n in ref[2]:
        assert torch.allclose(got[2][n], ref[2][n], atol=1e-5, rtol=1e-4), n
    with pytest.raises(ValueError, match="prefix needs attention_mask"):
        m(ids[:, P - 1:-1], attention_mask=attn[:, 1:-1], prefix=(ids[first, :P - 1], attn[first, :P - 1], rows))


def _peak_bytes(T, Vbig, chunk, D=32):
    """Peak of live torch CPU allocations (from the profiler's allocation events) over forward + backward."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    head = torch.nn.Linear(D, Vbig, bias=False)
    h = torch.randn(1, T, D, requires_grad=True)
    t = torch.randint(0, Vbig, (1, T))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp, ent = chunked_logprobs(h, head, t, 0.7, True, chunk)
        (logp.sum() + ent.sum()).backward()
        del logp, ent
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_chunked_logprobs_peak_memory_bounded_in_T():
    Vbig, chunk = 8192, 128
    full_4k = 4096 * Vbig * 4  # one (B*T, V) fp32 tensor at T=4096: 128 MiB
    small, large = _peak_bytes(512, Vbig, chunk), _peak_bytes(4096, Vbig, chunk)
    unchunked = _peak_bytes(4096, Vbig, chunk=4096)  # control: the measurement does see materialisation
    print(f"peak MiB: T=512 {small / 2**20:.1f}, T=4096 {large / 2**20:.1f}, "
          f"T=4096 unchunked {unchunked / 2**20:.1f}")
    assert unchunked > full_4k
    assert large < small + full_4k / 16  # 8x the tokens, (almost) no more memory
    assert large < full_4k / 4


# ---- vLLM: one in-process engine for the file, over a checkpoint saved by model.py ----
@pytest.fixture(scope="module", params=["qwen3", "llama"])
def vllm_ckpt(request, tmp_path_factory):
    pytest.importorskip("vllm")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    # qwen3: qk-norm, decoupled head_dim (vLLM's CPU attention needs head_dim >= 32), GQA 2, tied embeddings;
    # llama: llama3 rope scaling written in the transformers 5 dialect, GQA 4, untied
    if request.param == "qwen3":
        m = our_model("qwen3", tied=True, heads=4, kv_heads=2, head_dim=64, layers=3)
    else:
        m = our_model("llama", tied=False, heads=4, kv_heads=1, head_dim=32)
    path = m.save_pretrained(tmp_path_factory.mktemp("vllm") / "ckpt")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True, seed=0)
    yield llm, m
    llm.llm_engine.engine_core.shutdown()  # orderly, while the interpreter is still whole


@pytest.mark.slow
def test_vllm_prompt_logprobs_match(vllm_ckpt):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm, m = vllm_ckpt
    prompts = [rand_ids(1, n, seed=10 + n)[0].tolist() for n in (40, 17, 63)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    err = 0.0
    for p, out in zip(prompts, outs):
        theirs = torch.tensor([lp[tok].logprob for tok, lp in zip(p[1:], out.prompt_logprobs[1:])])
        ids = torch.tensor(p)[None]
        with torch.no_grad():
            ours = m(ids[:, :-1], targets=ids[:, 1:])[0]
        err = max(err, (ours - theirs).abs().max().item())
    print(f"vLLM {m.cfg.model_type} prompt logprobs max|d| = {err:.2e}")
    assert err <= 1e-4


def test_grpo_response_logp_equals_each_sequence_alone():
    """packing.response_logp (padded batch, shared prompts, any subset of rows) against the oracle: each
    prompt + completion run alone, unpadded, through a plain forward; padded and packed rows alike, zero past each
    response."""
    import packing
    from generator import Completion
    m = our_model("qwen2", kv_heads=1, layers=2)
    prompts = [rand_ids(1, n, seed=30 + i)[0].tolist() for i, n in enumerate([6, 3, 8])]
    lens = [[4, 1], [6, 6], [2, 5]]
    groups = [[Completion(p, rand_ids(1, n, seed=40 + 2 * i + j)[0].tolist(), "", [0.0] * n, "length", 0)
               for j, n in enumerate(ns)] for i, (p, ns) in enumerate(zip(prompts, lens))]
    batch = packing.make_batch([{"prompt_ids": p} for p in prompts], groups, pad_id=0)
    for rows, packed in itertools.product((torch.arange(6), torch.tensor([5, 0, 2, 3])), (False, True)):
        with torch.no_grad():  # the whole batch; a shuffled minibatch
            logp, ent = packing.response_logp(m, batch, rows, temperature=0.7, entropy=True, packed=packed)
        assert logp.shape == ent.shape == (len(rows), 6)
        for k, r in enumerate(rows.tolist()):
            c = groups[r // 2][r % 2]
            seq = torch.tensor(c.prompt_ids + c.token_ids)[None]
            with torch.no_grad():
                alone = m(seq[:, :-1], targets=seq[:, 1:], temperature=0.7)[0, len(c.prompt_ids) - 1:]
            assert (logp[k, :len(c.token_ids)] - alone).abs().max() < 1e-5, (rows, r)
            assert torch.isfinite(ent[k]).all() and not logp[k, len(c.token_ids):].any()


def test_pack_first_fit_decreasing():
    import packing
    lengths = [5, 0, 3, 8, 2, 2, 7, 1]
    bins = packing.first_fit(lengths, 8, decreasing=True)
    assert sorted(i for b in bins for i in b) == [0, 2, 3, 4, 5, 6, 7]  # each non-empty sequence exactly once
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins) and len(bins) == 4  # 28 tokens: 4 rows of 8
    assert bins == [[3], [6, 7], [0, 2], [4, 5]]  # longest first, each into the first row with room


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_update_equals_the_padded_batch(family):
    """The update's forward as the trainer runs it (packing.response_logp: shared prompts trimmed, responses
    packed several to a row) against the padded full batch through a plain forward: logprobs and entropies to 1e-6
    of their scale in fp32, and every parameter's gradient. Prompts of different lengths, groups of 3, 1 and 4,
    responses of 1 to 9 tokens (one empty), GQA; the micro-batch is a shuffled subset, as with
    train.minibatches > 1. Gradients are held to 1e-5 of their scale: summation order alone moves fp32 gradients
    by ~2e-6 here, and the padded shared-prompt path (no packing) is off by as much."""
    import packing
    from generator import Completion
    m = our_model(family, kv_heads=2, layers=3)
    prompts = [rand_ids(1, n, seed=50 + i)[0].tolist() for i, n in enumerate([9, 4, 6])]
    lens = [[5, 9, 2], [7], [1, 6, 0, 3]]
    groups = [[Completion(p, rand_ids(1, n, seed=60 + 4 * i + j)[0].tolist() if n else [], "", [0.0] * n, "stop", 0)
               for j, n in enumerate(ns)] for i, (p, ns) in enumerate(zip(prompts, lens))]
    batch = packing.make_batch([{"prompt_ids": p} for p in prompts], groups, pad_id=0)
    ids, attn, P, mask = batch["ids"], batch["attn"], batch["P"], batch["mask"]
    rows = torch.tensor([6, 0, 3, 1, 7, 4, 2])
    adv = torch.linspace(-1, 1, len(rows))[:, None]

    def loss_and_grads(logp, ent):
        (-(adv * logp * mask[rows]).sum() + 0.3 * (ent * mask[rows]).sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        return logp.detach(), ent.detach(), grads
    full = m(ids[rows, :-1], attention_mask=attn[rows, :-1], targets=ids[rows, 1:], temperature=0.7,
             return_entropy=True)
    ref = loss_and_grads(full[0][:, P - 1:], full[1][:, P - 1:])
    stats = {}
    got = loss_and_grads(*packing.response_logp(m, batch, rows, 0.7, entropy=True, packed=True, stats=stats))
    on = mask[rows].bool()

    def err(a, b):  # relative to the tensor's scale: one fp32 ulp at a logprob of -8 is 1e-6 already
        return float((a - b).abs().max() / b.abs().max())
    assert err(got[0][on], ref[0][on]) <= 1e-6 and err(got[1][on], ref[1][on]) <= 1e-6
    for n in ref[2]:  # summation order alone moves fp32 gradients by ~2e-6 here, padded shared prompts alike
        assert err(got[2][n], ref[2][n]) <= 1e-5, n
    # 27 response tokens in 3 rows of 9 (9 | 7 2 | 5 3 1; the empty one nowhere), the prompts but their last token
    # once each (8 + 3 + 5 real, left-padded to 8)
    assert (stats["tokens"], stats["real_tokens"]) == (3 * 8 + 3 * 9, 16 + 27)  # stats["flops"]: the test below
    assert packing.response_logp(m, batch, rows, 0.7, packed=None, stats={}).shape == (7, 9)  # the cheaper one
    with pytest.raises(ValueError, match=r"packed prefix needs position_ids \(B, T\) and mask_c"):
        m(ids[:2, P - 1:-1], targets=ids[:2, P:], prefix=(ids[:1, :P - 1], attn[:1, :P - 1], None, attn[:2, None]))


@pytest.mark.parametrize("layout", ["no_prefix", "shared_prefix", "packed"])
def test_forward_flops_equals_torch_flop_counter(layout):
    """packing.forward_flops, summed by response_logp into stats["flops"] (what the trainer logs as
    perf/update_gflop), against what the forward dispatches: torch's FlopCounterMode for the matmuls (it does not
    count CPU attention), and for attention 4 * q.numel() * keys from the shapes of every SDPA call seen. GQA, a
    tied head, prompts and responses of different lengths (SDPA computes the masked pairs too)."""
    import packing
    from generator import Completion
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class AttentionFlops(TorchDispatchMode):
        flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                q, k = args[0], args[1]
                self.flops += 4 * q.numel() * k.shape[-2]
            return func(*args, **(kwargs or {}))
    m = our_model("llama", tied=True, heads=4, kv_heads=2, head_dim=16, layers=3)
    plens = [1, 1] if layout == "no_prefix" else [9, 4]  # a 1-token prompt leaves no prefix to share
    prompts = [rand_ids(1, n, seed=70 + i)[0].tolist() for i, n in enumerate(plens)]
    groups = [[Completion(p, rand_ids(1, n, seed=80 + 3 * i + j)[0].tolist(), "", [0.0] * n, "stop", 0)
               for j, n in enumerate(ns)] for i, (p, ns) in enumerate(zip(prompts, [[7, 3, 2], [4, 3, 1]]))]
    batch = packing.make_batch([{"prompt_ids": p} for p in prompts], groups, pad_id=0)
    stats = {}
    with FlopCounterMode(display=False) as counter, AttentionFlops() as att, torch.no_grad():
        packing.response_logp(m, batch, torch.arange(6), 1.0, packed=layout == "packed", stats=stats)
    assert att.flops > 0 and set(counter.get_flop_counts()["Global"]) == {torch.ops.aten.mm}
    assert stats["flops"] == counter.get_total_flops() + att.flops
    assert stats["tokens"] == {"no_prefix": 6 * 7, "shared_prefix": 2 * 8 + 6 * 7, "packed": 2 * 8 + 3 * 7}[layout]
