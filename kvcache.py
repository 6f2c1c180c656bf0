"""The torch generator's KV cache: every layer's keys and values kept between decode steps, and a
decode step's attention over them.

    cache = KVCache(model.cfg, rows, max_len, dtype, device)
    model(prompt_ids, attention_mask=mask, kv_cache=cache, cache_pos=0)
        # prefill: writes columns 0 .. P-1
    model(next_ids, position_ids=pos, kv_cache=cache, cache_pos=P + t)
        # decode: writes column P + t, attends
        # to every column before it
model.Attention writes each forward's keys and values at cache_pos, and for one new token asks the
cache to attend (KVCache.attend); a prefill attends with SDPA as any forward does.

Shared prompts. GRPO samples G completions of every prompt, and causal attention makes the prompt's
keys and values the same in all G rows. So the generator prefills each distinct prompt once into one
cache and decodes in a second that holds only what each row generates (share_prefix): a decode step
attends to [prompt ; own tokens] without the prompt ever being copied G times. On CPU the G rows'
queries are stacked against their prompt's keys, which are then read once per step for all G rows
instead of once per row, and the two attentions merge by their log-sum-exps
l = log sum_j exp(q k_j / sqrt(D)):

    y_p, l_p = attn(q, K_prompt, V_prompt),    y_s, l_s = attn(q, K_own, V_own)
    y = (e^l_p y_p + e^l_s y_s) / (e^l_p + e^l_s) = y_s + sigmoid(l_p - l_s) (y_p - y_s)

which is the softmax over the concatenated keys, summed in another order. On a GPU (launch-bound at
decode, and no public kernel there returns l) each row's prompt is gathered in front of its own keys
for one SDPA instead.
Sharing pays with long prompts and costs nothing with short ones
(docs/performance.md#each-prompts-keys-held-once).

Left out: paged blocks (each generate() call has one contiguous buffer), reusing a prompt's keys
across calls (vLLM's prefix cache), and sharing what the G rows generate.
"""
import torch
import torch.nn.functional as F


def additive(mask, dtype):
    """bool mask, True = attend -> 0 / -inf, to add to the scores."""
    return (torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            .masked_fill_(~mask, float("-inf")))


class KVCache:
    """Preallocated keys and values for every layer:
    (num_layers, B, num_kv_heads, max_len, head_dim)."""

    def __init__(self, cfg, batch_size: int, max_len: int, dtype, device):
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len, self.prefix = max_len, None

    def share_prefix(self, prefix, mask, n):
        """Rows i*n .. i*n + n-1 continue prompt i, whose keys and values sit once in `prefix` (a
        KVCache of U rows; mask (U, P): 1 = real token): this cache holds only what each row
        adds."""
        self.prefix, self.n = prefix, n
        self.prefix_mask = additive(mask[:, None, None, :].bool(), prefix.k.dtype)  # (U, 1, 1, P)
        self._rows(torch.arange(mask.shape[0] * n, device=mask.device))

    def _rows(self, live):
        """live (b,): batch row -> the row it started as; then each row's prompt and its prompt
        mask, set once here rather than at every layer of every step."""
        self.live, self.prompt = live, live // self.n
        self.row_mask = self.prefix_mask[self.prompt]  # (b, 1, 1, P)

    def keep(self, rows):
        """Only these batch rows decode on; a prompt's keys stay while any of its rows runs."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        if self.prefix is not None:
            self._rows(self.live[rows])

    def attend(self, q, k, v, mask, layer, fold=None):
        """One decode step: q (b, H, 1, D) against each row's cached k, v (b, H_kv, S, D) under mask
        (b, 1, 1, S) bool or None, after the row's prompt where one is shared. A KV head's H / H_kv
        query heads are the rows of one attention (CPU's bf16 SDPA with enable_gqa ran 4x slower,
        bench/decode.py). fold: stack a prompt's rows against its keys and merge by log-sum-exp (the
        module docstring); None = on CPU."""
        b, H, _, D = q.shape
        Hk = k.shape[1]
        q = q.view(b, Hk, H // Hk, D)
        if self.prefix is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(b, H, 1, D)
        U, n, kp, vp = (self.prefix_mask.shape[0], self.n, self.prefix.k[layer],
                        self.prefix.v[layer])
        mask = None if mask is None else additive(mask, q.dtype)
        if not (q.device.type == "cpu" if fold is None else fold):
            i = self.prompt
            both = (F.pad(self.row_mask, (0, k.shape[2])) if mask is None
                    else torch.cat([self.row_mask, mask], -1))
            y = F.scaled_dot_product_attention(q, torch.cat([kp[i], k], 2),
                                               torch.cat([vp[i], v], 2), attn_mask=both)
            return y.view(b, H, 1, D)
        everyone = b == U * n  # no row has left yet: stacking is a reshape

        # (b, Hk, g, D) batch rows -> (U, Hk, n*g, D): a prompt's n rows (rows that left: zeros)
        def stack(x):
            full = x if everyone else x.new_zeros(U * n, *x.shape[1:]).index_copy_(0, self.live, x)
            return full.view(U, n, Hk, -1, D).transpose(1, 2).reshape(U, Hk, -1, D)

        def unstack(x):  # (U, Hk, n*g, X) -> (b, Hk, g, X)
            x = (x.view(U, Hk, n, -1, x.shape[-1]).transpose(1, 2)
                 .reshape(U * n, Hk, -1, x.shape[-1]))
            return x if everyone else x[self.live]
        # SDPA's CPU kernel -> (y, log-sum-exp)
        attn = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        y_p, l_p = attn(stack(q), kp, vp, attn_mask=self.prefix_mask)
        y_s, l_s = attn(q, k, v, attn_mask=mask)
        # the prompt's share of the softmax mass
        w = torch.sigmoid(unstack(l_p[..., None]) - l_s[..., None])
        return torch.lerp(y_s, unstack(y_p), w.to(q.dtype)).view(b, H, 1, D)
