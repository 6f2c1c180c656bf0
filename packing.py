"""The update's batch: how one step's episodes become tensors, and how those go through the model.

make_batch lays a step out padded, the layout the losses see: prompts left-padded to P columns,
responses right-padded to R, so every response starts at column P; logprobs, advantages and masks
are (rows, R).

The model never runs that layout as it is. response_logp takes a micro-batch's rows and
- runs each distinct prompt once (model.SharedPrefix: the G rows of a group share their prompt's
  keys), its left padding trimmed to the longest prompt of the micro-batch;
- packs the responses: first-fit decreasing into rows as long as the longest response, each response
  attending to its own prompt and to itself causally (a block-diagonal mask), at the positions it
  has in the padded layout.
  Packing is taken where forward_flops says it computes less than the padded rows, which also pay
  attention over every prompt of the micro-batch (a dense mask computes the masked pairs too);
- scatters the logprobs back to (rows, R), zero past each response.
The result equals the padded rows' logprobs and gradients to float rounding (tests/test_model.py).
The trainer logs perf/pad_frac = computed tokens / real tokens: the waste left after sharing,
trimming and packing.

Left out: sorting rows by length across micro-batches (it would change which rows share a
micro-batch, and so the token-mean normalisation), and packing the prompts themselves (a micro-batch
holds few distinct prompts).
"""
import torch

from model import ModelConfig, block_causal, mask_positions


def forward_flops(cfg: ModelConfig, tokens: int, attn_pairs: int, logit_tokens: int) -> int:
    """Matmul FLOPs of one forward pass (2 per multiply-add): every block weight once per token, the
    lm_head only where logits are taken, and attention's two products (q k^T, then p v) over every
    (query, key) pair SDPA computes (a dense mask computes the masked pairs too). A backward costs
    twice a forward, so an update is 3x this: the "6 * params * tokens" rule, counted per part.
    Norms, RoPE, softmax and the optimizer are left out (not matmuls)."""
    D, L, hd = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    block = (D * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
             + 3 * D * cfg.intermediate_size)
    attention = 4 * L * cfg.num_attention_heads * hd * attn_pairs
    return 2 * (L * block * tokens + D * cfg.vocab_size * logit_tokens) + attention


def make_batch(problems, groups, pad_id):
    """Left-pad prompts and right-pad responses, so every response starts at column P."""
    seqs = [(p["prompt_ids"], c) for p, comps in zip(problems, groups) for c in comps]
    P = max(len(p) for p, _ in seqs)
    R = max(max(len(c.token_ids) for _, c in seqs), 1)
    ids = torch.full((len(seqs), P + R), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    gen_logp = torch.zeros(len(seqs), R)
    # 1 on response tokens (sampled ones only, in a multi-turn episode)
    mask = torch.zeros(len(seqs), R)
    for i, (p, c) in enumerate(seqs):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        attn[i, P - len(p):P + len(c.token_ids)] = 1
        gen_logp[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
        mask[i, :len(c.token_ids)] = 1
        if c.mask is not None:
            mask[i, :len(c.mask)] = torch.tensor(c.mask, dtype=torch.float32)
    # the weight version that sampled each row's first token, and each token's (an in-flight update
    # changes it mid-row: generator.Completion.versions)
    version = torch.tensor([float(c.generator_version) for _, c in seqs])
    tok_version = version[:, None].repeat(1, R)
    for i, (_, c) in enumerate(seqs):
        if c.versions:
            tok_version[i, :len(c.versions)] = torch.tensor(c.versions, dtype=torch.float32)
    prompt = torch.tensor([i for i, comps in enumerate(groups) for _ in comps])  # row -> its prompt
    return dict(ids=ids, attn=attn, mask=mask, gen_logp=gen_logp, P=P, version=version,
                tok_version=tok_version, prompt=prompt)


def first_fit(lengths, capacity, decreasing=False):
    """The one packer (SFT's rows and the update's bins): -> bins, each a list of indices into
    `lengths` summing to <= capacity; every item goes to the first bin with room, in index order
    or, `decreasing`, longest first (first-fit decreasing; ties keep their order, sorted is
    stable), so a batch packs the same way on every rank and every resume. capacity 0: one item a
    bin. Items of length 0 get no bin."""
    bins, room, n = [], [], len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i]) if decreasing else range(n)
    for i in order:
        if lengths[i] == 0:
            continue
        fits = (j for j, r in enumerate(room) if r >= lengths[i])
        j = next(fits, len(bins)) if capacity else len(bins)
        if j == len(bins):
            bins.append([])
            room.append(capacity)
        bins[j].append(i)
        room[j] -= lengths[i]
    return bins


def packed_mask(doc, rows, prompt_mask):
    """doc (K, T), K packed rows (bins): which completion each packed token is (-1 = padding);
    rows: each completion's prompt; prompt_mask (U, Pp) -> (K, 1, T, U*Pp + T) bool: a token sees
    its own prompt's real tokens, then its own completion causally. A padding token sees itself
    only (never nothing: NaN); its output is unused."""
    (K, T), (U, Pp), dev = doc.shape, prompt_mask.shape, doc.device
    own = torch.where(doc >= 0, rows[doc.clamp(min=0)], -1)  # each token's prompt; -1 = padding
    prompt_of_key = torch.arange(U, device=dev).repeat_interleave(Pp)
    see_prompt = (own[:, :, None] == prompt_of_key) & prompt_mask.reshape(1, 1, -1).bool()
    see_self = (block_causal(doc) & (doc[:, :, None] >= 0)
                | torch.eye(T, dtype=torch.bool, device=dev))
    return torch.cat([see_prompt, see_self], -1)[:, None]


def response_logp(model, batch, rows, temperature, entropy=False, packed=None, stats=None):
    """Policy logprobs (and entropy) of the response tokens of `rows`: (b, R) fp32, 0 past each
    response.
    packed: None = where it computes fewer FLOPs, or True / False (with a prompt of >= 2 tokens).
    stats: a dict that sums "tokens" (computed), "real_tokens" and "flops" (forward_flops of the
    forward run) over calls."""
    ids, attn, P = batch["ids"][rows], batch["attn"][rows], batch["P"]
    b, R = ids.shape[0], ids.shape[1] - P
    # response tokens per row; their logprobs come from the inputs at P-1 .. P+L-2
    L = attn[:, P:].sum(1)
    T = max(int(L.max()), 1)
    uniq, inv = torch.unique(batch["prompt"][rows], return_inverse=True)
    # a row per prompt
    first = torch.zeros_like(uniq).scatter_(0, inv, torch.arange(len(inv), device=inv.device))
    # the prompts but their last token, left padding trimmed
    Pp = int(attn[first, :P].sum(1).max()) - 1
    p_ids, p_mask = ids[first, P - 1 - Pp:P - 1], attn[first, P - 1 - Pp:P - 1]
    x, y = ids[:, P - 1:P - 1 + T], ids[:, P:P + T]  # inputs and targets of the padded rows
    lengths = L.tolist()
    bins = first_fit(lengths, T, decreasing=True)
    U, K = len(uniq), len(bins)
    padded_cost = forward_flops(model.cfg, U * Pp + b * T, U * Pp * Pp + b * T * (Pp + T), b * T)
    packed_cost = forward_flops(model.cfg, U * Pp + K * T, U * Pp * Pp + K * T * (U * Pp + T),
                                K * T)
    # packing needs a prefix
    packed = (packed_cost < padded_cost if packed is None else packed) and Pp > 0
    if stats is not None:
        for k, v in (("tokens", U * Pp + (K if packed else b) * T),
                     ("real_tokens", int(p_mask.sum()) + int(L.sum())),
                     ("flops", packed_cost if packed else padded_cost)):
            stats[k] = stats.get(k, 0) + v
    if not packed:
        prefix = (p_ids, p_mask, inv) if Pp > 0 else None
        out = model(x, attention_mask=attn[:, P - 1 - Pp:P - 1 + T], targets=y,
                    temperature=temperature, return_entropy=entropy, prefix=prefix)
        real = attn[:, P:P + T].bool()

        def unpad(o):  # (b, T) -> (b, R), zero where a shorter row's padding was computed
            return torch.nn.functional.pad(torch.where(real, o, 0.0), (0, R - T))
        return tuple(map(unpad, out)) if entropy else unpad(out)
    # which row each packed token comes from; -1 = padding
    doc = torch.full((K, T), -1, dtype=torch.long)
    col = torch.zeros((K, T), dtype=torch.long)  # and its column there
    for r, members in enumerate(bins):
        start = 0
        for i in members:
            n = lengths[i]
            doc[r, start:start + n], col[r, start:start + n] = i, torch.arange(n)
            start += n
    # built on the host: one copy, not a launch per response
    doc, col = doc.to(ids.device), col.to(ids.device)
    src, real = doc.clamp(min=0), doc >= 0
    # each input's position in the padded layout
    pos = mask_positions(attn[:, :P - 1 + T])[:, P - 1:]
    out = model(x[src, col], position_ids=pos[src, col] * real, targets=y[src, col],
                temperature=temperature, return_entropy=entropy,
                prefix=(p_ids, p_mask, None, packed_mask(doc, inv, p_mask)))

    def unpack(o):  # (K, T) packed -> (b, R) padded, through autograd
        return o.new_zeros(b, R).index_put((doc[real], col[real]), o[real])
    return tuple(map(unpack, out)) if entropy else unpack(out)


def no_grad_logp(model, batch, micro, temperature):
    with torch.no_grad():
        return torch.cat([response_logp(model, batch, slice(i, i + micro), temperature)
                          for i in range(0, len(batch["ids"]), micro)])
