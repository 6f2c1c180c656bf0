"""Rollout generation: turn prompt token ids into sampled completions with per-token logprobs.

Two backends behind one API, chosen by `rollout.backend = "vllm" | "torch" | "auto"` (auto: vLLM on
a GPU; on CPU whichever was measured faster for the configured layout, model size and generation
length: engine.default_backend):

    gen = make_generator("vllm", "path/to/hf_ckpt")
    groups = gen.generate(prompt_ids, n=8, temperature=1.0, max_tokens=256,
                          stop_token_ids=tok.eos_token_ids)
    groups[i][j].token_ids, groups[i][j].logprobs        # prompt i, sample j
    gen.update_weights(model.named_parameters(), version=step)   # after each optimizer step

* `VLLMGenerator`: an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the model lives
  in this process and we can reach its weights). Prompts go in as token ids and nothing is
  detokenised in the hot path (SamplingParams(detokenize=False), skip_tokenizer_init): text is
  decoded once per batch at the end, which is ~10x faster on CPU. KV-cache memory is an explicit
  byte count, never a fraction of the machine (vLLM's default 0.92 of RAM is refused on a shared CPU
  box); `max_num_seqs` should be >= prompts * n so a rollout batch is one engine batch.
* `TorchGenerator`: the same API over model.py: left-padded batched prefill into a preallocated
  KVCache (once per prompt, its keys then shared by its n samples), then one batched decode step per
  token with temperature, top-k, top-p sampling and per-row stop tokens; finished rows leave the
  decode batch (their KV rows are dropped) so they stop costing work; on CPU in fp32 its large
  Linears run on oneDNN-reordered weights (machine.onednn_weights). For machines without vLLM, and
  as the reference in tests.

Logprobs. Each Completion carries logp_t = log softmax(logits_t / T)[token_t] in fp32: the
log-probability under the policy that actually sampled (vLLM's
`logprobs_mode="processed_logprobs"`); model.py's forward(targets=, temperature=T) computes the same
quantity. Why the tempered policy and not the raw one: the losses' old_logprobs (PPO ratio) and
truncated importance sampling correct for the behaviour policy, and sampling at T != 1 *is* a
different policy from the T=1 model. At T=0 (greedy) there is no tempering: logp = log
softmax(logits). Known gap: with top-k/top-p on, the behaviour policy is renormalised over the kept
tokens; both generators report that renormalised logp (they sample from it), while the trainer's
log_softmax(logits/T) is not renormalised. The two differ by log(mass of the kept tokens); leave
top_k/top_p off for RL, or accept that bias.

Stop tokens: `stop_token_ids=None` means the checkpoint's eos ids (generation_config.json, else
config.json). The stop token is kept in token_ids (with its logprob) and finish_reason is "stop";
hitting max_tokens (or max_model_len) is "length". A stop token on the last allowed step counts as
"stop", as in vLLM.

Start order on a torchrun rank (dedicated generator ranks, and colocated mode where every rank hosts
an engine): build VLLMGenerator FIRST, then call gen.release_default_group(), then
dist.init_process_group(). vLLM's engine start calls init_process_group itself (a private 1-rank
file:// group) when torch.distributed is not initialised; if the torchrun world already exists it
adopts it instead and makes a series of collective new_group() calls over all ranks, which the
trainer ranks never join: a deadlock. release_default_group() destroys the private group (vLLM's
groups all have size 1 and never communicate) and detaches vLLM's shutdown finalizer, which would
otherwise destroy *our* world group at exit. In plain python (a world of 1) it is harmless to call.

On a GPU (engine_args): CUDA graphs unless `enforce_eager`; KV memory an explicit byte count, with
vLLM's `gpu_memory_utilization x total` check made first with an error naming the config field;
colocated, the engine has `enable_sleep_mode=True` and sleeps around the update, waking weights ->
load -> KV cache (vLLM 0.32's order and where it is in its source: docs/gpu.md). On CPU the same
calls run, so the order is tested there.

In-flight weight updates (`generate(..., poll=)`): poll runs at every token boundary (the torch
generator between decode steps; vLLM's engine, stepped by hand, between scheduler steps) and may
load new weights. The rows still running go on under them over the KV cache the old weights wrote
(kept, not recomputed, as PipelineRL does), and each token records the version whose forward sampled
it (Completion.versions) beside its logprob, which is exactly the sampler's: so the trainer's ratio
and every correction stay per token and exact (tests/test_generator.py: an update that changes only
the final norm, on which no KV depends, against both models teacher-forced).

Deliberately left out: streaming generation, multi-GPU tensor parallelism inside vLLM, vLLM's
own LoRA serving (a LoRA run's generators load merged weights: lora.py), stop strings.
"""
import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

import kvcache
import machine
import seeds


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]           # generated tokens, stop token included when finish_reason ==
    #                                "stop"
    text: str                      # decoded once at the end, special tokens skipped
    logprobs: list[float]          # fp32 log softmax(logits/T) at each generated token (see module
    #                                docstring)
    finish_reason: str             # "stop" | "length"
    generator_version: int         # weight version that produced it (see update_weights); with
    #                                an in-flight update, the oldest that sampled any of its tokens
    metadata: dict = field(default_factory=dict)
    mask: list[int] | None = None  # a multi-turn episode's loss mask: 1 sampled, 0 env tokens
    #                                (episodes.py)
    versions: list[int] | None = None  # per token, the weight version that sampled it, where an
    #                                in-flight update (`poll`) changed it mid-sequence; None: all
    #                                generator_version

    def token_versions(self) -> list[int]:
        return self.versions or [self.generator_version] * len(self.token_ids)


def make_generator(backend: str, model_path, **kw):
    if backend == "vllm":
        return VLLMGenerator(model_path, **kw)
    if backend == "torch":
        return TorchGenerator(model_path, **kw)
    raise ValueError(f"generator.backend must be 'vllm' or 'torch', got {backend!r}")


def check_completions(groups, num_prompts: int, n: int):
    """A generator that silently drops samples would surface later as a shape error far from the
    cause."""
    if len(groups) != num_prompts:
        raise RuntimeError(
            f"generator returned {len(groups)} completion groups for {num_prompts} prompts")
    for i, g in enumerate(groups):
        if len(g) != n:
            raise RuntimeError(
                f"generator returned {len(g)} completions for prompt {i}, expected n={n}")
    return groups


def eos_token_ids(model_path) -> list[int]:
    """The checkpoint's end-of-sequence ids: generation_config.json first (it may list several),
    then config.json."""
    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def _decoder(model_path):
    """decode_batch from the checkpoint's tokenizer.json, or None (then text is "")."""
    f = Path(model_path) / "tokenizer.json" if model_path is not None else None
    if f is None or not f.exists():
        return None
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(f))
    return lambda seqs: tok.decode_batch(seqs, skip_special_tokens=True)


def _check_args(prompt_ids, n, temperature, max_tokens):
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError(
            "generate needs a non-empty list of non-empty prompts (lists of token ids)")
    if n < 1 or max_tokens < 1 or temperature < 0:
        raise ValueError(f"need n >= 1, max_tokens >= 1, temperature >= 0 (got {n}, {max_tokens}, "
                         f"{temperature})")


# --------------------------------------------------------------------------------------------------
# vLLM


def engine_args(device_type, *, colocated, kv_cache_memory_bytes, gpu_memory_utilization=0.9,
                enforce_eager=None, free_bytes=0, total_bytes=0) -> dict:
    """The device-dependent LLM(...) arguments (module docstring), a pure function: tests pass
    made-up GPU numbers. vLLM 0.32 refuses enable_sleep_mode on CPU (config/model.py
    ModelConfig.__post_init__), and on CUDA raises unless free
    memory >= gpu_memory_utilization x total (v1/worker/utils.py request_memory): checked here
    first."""
    args = dict(kv_cache_memory_bytes=kv_cache_memory_bytes,
                enforce_eager=device_type != "cuda" if enforce_eager is None else enforce_eager)
    if device_type != "cuda":
        return args
    u, gib = gpu_memory_utilization, 2**30
    if u * total_bytes > free_bytes:
        raise ValueError(f"rollout.gpu_memory_utilization={u} asks vLLM for "
                         f"{u * total_bytes / gib:.1f} of the GPU's {total_bytes / gib:.1f} GiB, "
                         f"but only {free_bytes / gib:.1f} GiB is free: use at most "
                         f"{int(free_bytes / total_bytes * 100) / 100}")
    if kv_cache_memory_bytes >= u * total_bytes:
        raise ValueError(f"rollout.kv_cache_mb={kv_cache_memory_bytes >> 20} does not fit in "
                         f"vLLM's budget, rollout.gpu_memory_utilization={u} x "
                         f"{total_bytes / gib:.1f} GiB, which holds the weights too")
    return {**args, "gpu_memory_utilization": u, "enable_sleep_mode": colocated}


def request_seed(seed, k):
    """The k-th request of a generate() call seeded `seed` (seeds.py: its own stream, never another
    call's)."""
    return seeds.seed(seed, "request", k)


class VLLMGenerator:
    def __init__(self, model_path, *, max_model_len=1024, kv_cache_memory_bytes=256 << 20,
                 max_num_seqs=256, dtype="float32", seed=0, enforce_eager=None,
                 gpu_memory_utilization=0.9, colocated=False):
        # In-process engine: required to reach the model runner for in-place weight updates.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        from vllm import LLM
        cuda = torch.cuda.is_available()
        free, total = torch.cuda.mem_get_info() if cuda else (0, 0)
        mem = engine_args("cuda" if cuda else "cpu", colocated=colocated,
                          kv_cache_memory_bytes=kv_cache_memory_bytes,
                          gpu_memory_utilization=gpu_memory_utilization,
                          enforce_eager=enforce_eager, free_bytes=free, total_bytes=total)
        self.llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, seed=seed, skip_tokenizer_init=True,
                       logprobs_mode="processed_logprobs", **mem,
                       # NOTE: no chunked prefill. A prompt split across engine steps makes vLLM
                       # rewind the request's seeded torch.Generator, which CPU generators cannot do
                       # (RuntimeError "CPU Generator does not use offset", vLLM 0.32). Whole
                       # prompts need a budget >= max_model_len.
                       enable_chunked_prefill=False,
                       max_num_batched_tokens=max(4096, max_model_len))
        self.model_path, self.max_num_seqs, self.version, self.asleep = (
            str(model_path), max_num_seqs, 0, False)
        self.eos_ids, self._decode = eos_token_ids(model_path), _decoder(model_path)
        changed = {k for k in nccl_env.keys() | os.environ.keys() if k.startswith("NCCL_")
                   and nccl_env.get(k) != os.environ.get(k)}
        # dist.rank_env set them alike on every rank; a rank whose NCCL settings differ from its
        # peers' can break the weight broadcast
        if changed and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise RuntimeError(f"building the vLLM engine changed {sorted(changed)} on this rank "
                               "only: set them for the whole job (e.g. NCCL_CUMEM_ENABLE=0 "
                               "torchrun ...)")

    def release_default_group(self):
        """Call after __init__ and before dist.init_process_group() (see the module docstring for
        why)."""
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()  # vLLM's private 1-rank group (and its size-1 subgroups)
        # NOTE: private attribute. vLLM's finalizer runs
        # destroy_model_parallel + destroy_process_group at exit, which would raise on the dead
        # groups above and then tear down our torchrun world group.
        self.llm.llm_engine.engine_core._finalizer.detach()

    def generate(self, prompt_ids, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64,
                 stop_token_ids=None, seed=None, poll=None) -> list[list[Completion]]:
        """poll: as TorchGenerator.generate's; given, the engine is stepped here, one scheduler
        step (one token per running request) at a time, and the hook runs between steps."""
        from vllm import SamplingParams, TokensPrompt
        _check_args(prompt_ids, n, temperature, max_tokens)
        stop = self.eos_ids if stop_token_ids is None else list(stop_token_ids)

        # One request per (prompt, sample) with n=1: vLLM rejects greedy with n>1, and a seed per
        # request (request_seed) makes every sample reproducible on its own. vLLM's own n>1 fans out
        # the same way.
        def params(s):
            return SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k,
                                  max_tokens=max_tokens,
                                  # stop exactly on `stop`, nothing else
                                  stop_token_ids=stop, ignore_eos=True,
                                  seed=s, logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(n)]
        sp = (params(None) if seed is None
              else [params(request_seed(seed, k)) for k in range(len(prompts))])
        first = self.version
        if poll is None:
            rows = [o.outputs[0] for o in self.llm.generate(prompts, sp, use_tqdm=False)]
            rows = [(list(r.token_ids), [r.logprobs[t][tok].logprob for t, tok in
                                         enumerate(r.token_ids)], None, r.finish_reason)
                    for r in rows]
        else:
            rows = self._stepped(prompts, sp if isinstance(sp, list) else [sp] * len(prompts),
                                 poll)
        texts = self._decode([r[0] for r in rows]) if self._decode else [""] * len(rows)
        groups = [[] for _ in prompt_ids]
        for k, ((toks, logp, versions, finish), text) in enumerate(zip(rows, texts)):
            groups[k // n].append(Completion(
                prompt_ids=list(prompt_ids[k // n]), token_ids=toks, text=text, logprobs=logp,
                finish_reason="stop" if finish == "stop" else "length",
                generator_version=first,
                versions=versions if versions and versions[-1] != first else None,
                metadata={"backend": "vllm", "sample_index": k % n}))
        return check_completions(groups, len(prompt_ids), n)

    def _stepped(self, prompts, params, poll):
        """LLM.generate's loop, by hand: each request streams its new tokens (DELTA), tagged with
        the weight version of the step that sampled them, and `poll` runs between steps. A request
        admitted after an update may reuse prefix-cache blocks the old weights wrote, as a running
        one reuses its own KV: what sampled is still what its logprobs record."""
        from vllm.sampling_params import RequestOutputKind
        engine, ids = self.llm.llm_engine, []
        for k, (prompt, p) in enumerate(zip(prompts, params)):
            p = p.clone()
            p.output_kind = RequestOutputKind.DELTA
            ids.append(f"inflight-{k}")  # outputs carry it (vLLM adds a suffix inside)
            engine.add_request(ids[-1], prompt, p)
        rows, first = {i: ([], [], [], None) for i in ids}, self.version
        while engine.has_unfinished_requests():
            version = self.version  # the weights this step samples with
            for out in engine.step():
                toks, logp, versions, _ = rows[out.request_id]
                r = out.outputs[0]
                toks += r.token_ids
                logp += [lp[tok].logprob for lp, tok in zip(r.logprobs, r.token_ids)]
                versions += [version] * len(r.token_ids)
                if out.finished:
                    rows[out.request_id] = (toks, logp, versions, r.finish_reason)
            poll()
        if self.version != first:  # update_weights could not reset the prefix cache while blocks
            self.llm.reset_prefix_cache()  # were in use: now none is
        return [rows[i] for i in ids]

    def _load_weights(self, named_tensors):
        """Reload HF-named tensors in place. Not enough on its own: the prefix cache still holds
        old-weight KV."""
        # On CPU vLLM repacks linear weights for oneDNN and leaves empty Parameters behind, so
        # model.load_weights fails; reload_weights rebuilds each layer and re-runs the repacking. It
        # reprocesses only one owner of a tied parameter, so a tied lm_head keeps a packed copy of
        # the old embedding: repack it by hand.
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        model = runner.get_model()
        lm_head, embed = getattr(model, "lm_head", None), model.model.embed_tokens
        if (lm_head is not None and lm_head is not embed
                and getattr(lm_head, "weight", None) is embed.weight):
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def update_weights(self, named_tensors, version: int):
        """named_tensors: iterable of (hf_name, tensor), e.g. model.named_parameters(). Call with no
        request in flight. The prefix-cache reset matters: cached KV blocks computed with the old
        weights would otherwise be reused for repeated prompts (measured logprob error ~1.8).
        Asleep: weights wake first, KV after the load."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self._load_weights(named_tensors)
        self.llm.reset_prefix_cache()
        if self.asleep:
            if not self.llm.wake_up(tags=["kv_cache"]):
                raise RuntimeError("vLLM is not fully awake after waking weights and kv_cache")
            self.asleep = False
        self.version = version

    def sleep(self, keep_weights=True):
        """Free the engine's GPU memory (colocated: for the update). Level 1 keeps a host copy of
        the weights; level 2 drops them, for when update_weights follows before the next
        generate."""
        self.llm.sleep(level=1 if keep_weights else 2)
        self.asleep = True

    def wake_up(self):
        if self.asleep:
            self.llm.wake_up()  # every tag: weights (when still asleep) and the KV cache
            self.asleep = False


# --------------------------------------------------------------------------------------------------
# pure torch


SAMPLE_BLOCK = 256  # vocabulary entries per block of the two-level inverse-CDF draw in sample()


def sample(logits, temperature, top_k, top_p, generator, u=None):
    """logits (R, V) fp32 -> tokens (R,), logp (R,) under the distribution sampled from (module
    docstring). u (R, 1): the rows' uniforms, if the caller draws them (TorchGenerator does, so that
    a row's random stream does not depend on which other rows are still in the batch); else drawn
    here from `generator`.

    The draw is an inverse CDF, one uniform per row (far cheaper on CPU than an exponential per
    vocabulary entry), in two levels: the mass of each block of SAMPLE_BLOCK entries, a cumulative
    sum over the blocks to find the block, then one over that block's entries. A cumulative sum runs
    serially along a row, and over all 49,152 entries it was the largest part of a CPU decode step's
    sampling (docs/performance.md#where-a-step-goes)."""
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    if temperature != 1.0:
        logits = logits / temperature
    # like vLLM: keep every token >= the k-th largest logit (ties included)
    if 0 < top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # like vLLM: drop the smallest tokens whose total mass is <= 1 - p
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False          # keep at least one
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    (R, V), n = logits.shape, SAMPLE_BLOCK
    top = logits.amax(-1, keepdim=True)
    e = (logits - top).exp_()        # unnormalised probabilities; filtered tokens 0
    if V % n:
        e = torch.nn.functional.pad(e, (0, n - V % n))  # zero mass past the vocabulary
    blocks = e.view(R, -1, n)
    mass = blocks.sum(-1)            # (R, V / n)
    cdf = mass.cumsum(-1)
    if u is None:
        u = torch.rand(R, 1, generator=generator, device=cdf.device, dtype=cdf.dtype)
    x = u.to(cdf.dtype) * cdf[:, -1:]

    # the first entry whose cumulative mass exceeds x; where rounding puts x past them all, the last
    # entry with mass (never a filtered one)
    def first_above(cdf, x, p):
        i = torch.searchsorted(cdf, x, right=True)
        return torch.minimum(
            i, ((p > 0) * torch.arange(p.shape[-1], device=p.device)).amax(-1, keepdim=True))
    b = first_above(cdf, x, mass)    # (R, 1) the block
    inner = blocks[torch.arange(R, device=e.device), b[:, 0]]
    x = x - (cdf.gather(-1, b) - mass.gather(-1, b))  # the mass still to go inside the block
    tok = (b * n + first_above(inner.cumsum(-1), x, inner))[:, 0]
    return tok, logits.gather(-1, tok[:, None])[:, 0] - top[:, 0] - cdf[:, -1].log()


class TorchGenerator:
    # drop finished rows from the decode batch (False: the old loop, for bench/generate.py)
    compact_finished = True

    def __init__(self, model_or_path, *, max_model_len=1024, dtype=None, device="cpu", seed=0,
                 tokenizer_path=None, onednn=True):
        # reordered Linears on CPU (machine.onednn_weights; False: F.linear; rollout.onednn)
        self.onednn = onednn
        # dtype: the compute dtype (KV cache included). None = the parameters' dtype; pass it for an
        # FSDP2 module with bf16 mixed precision, whose stored parameters stay fp32 while attention
        # runs in bf16.
        import model as model_lib
        self._lib = model_lib
        # share the trainer's module (colocated, tests)
        if isinstance(model_or_path, torch.nn.Module):
            self.model, path = model_or_path, tokenizer_path
        else:
            path = tokenizer_path or model_or_path
            self.model = model_lib.Transformer.from_pretrained(
                model_or_path, dtype=dtype or torch.float32, device=device)
        self.model.eval()
        self.dtype, self._own, self._packed = (
            dtype, not isinstance(model_or_path, torch.nn.Module), None)
        self.max_model_len, self.version = max_model_len, 0
        self.device = next(self.model.parameters()).device
        self.eos_ids, self._decode = (eos_token_ids(path) if path else []), _decoder(path)
        self.rng = torch.Generator(self.device).manual_seed(seed)

    # machine.onednn_weights: per weight version; per call for a shared module
    def fast_linears(self, rows):
        # not fp32 weights run in bf16
        use = self.onednn and self.dtype in (None, next(self.model.parameters()).dtype)
        packed = [] if not use else self._packed if self._own and self._packed else \
            machine.onednn_weights(self.model, rows)
        self._packed = packed if self._own else None
        return machine.linears_on(self.model, packed)

    @torch.no_grad()
    def generate(self, prompt_ids, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64,
                 stop_token_ids=None, seed=None, poll=None) -> list[list[Completion]]:
        """poll: an in-flight weight update's hook, called at every token boundary; it may load new
        weights (update_weights) and says so by returning True. The rows still running go on under
        them, and each token records the version that sampled it (module docstring)."""
        _check_args(prompt_ids, n, temperature, max_tokens)
        # compiled blocks (dist.compile) run eagerly here: a KV-cache decode changes shape every
        # token, and torch 2.13 fails to compile it (tests/test_dist.py, compiled2)
        with torch.compiler.set_stance("force_eager"), contextlib.ExitStack() as linears:
            linears.enter_context(self.fast_linears(len(prompt_ids) * n))

            def polled():  # new weights: the reordered copies are of the old ones
                if poll is None or not poll():
                    return False
                linears.close()
                linears.enter_context(self.fast_linears(len(prompt_ids) * n))
                return True
            return self._generate(prompt_ids, n, temperature, top_p, top_k, max_tokens,
                                  stop_token_ids, seed, polled)

    def _generate(self, prompt_ids, n, temperature, top_p, top_k, max_tokens, stop_token_ids, seed,
                  polled):
        stop = torch.tensor(self.eos_ids if stop_token_ids is None else list(stop_token_ids),
                            dtype=torch.long, device=self.device)
        rng = self.rng if seed is None else torch.Generator(self.device).manual_seed(seed)
        B, P, dev = len(prompt_ids), max(len(p) for p in prompt_ids), self.device
        if P >= self.max_model_len:
            raise ValueError(
                f"prompt of {P} tokens does not fit max_model_len={self.max_model_len}")
        T = min(max_tokens, self.max_model_len - P)
        cfg, dtype = self.model.cfg, self.dtype or next(self.model.parameters()).dtype

        # 1) prefill each prompt once, left-padded so every prompt ends at column P. Built on the
        # host and moved once: one copy to a GPU, not one per prompt.
        ids = torch.zeros(B, P, dtype=torch.long)
        pmask = torch.zeros(B, P, dtype=torch.long)  # 1 = real token
        for i, p in enumerate(prompt_ids):
            ids[i, P - len(p):] = torch.tensor(p)
            pmask[i, P - len(p):] = 1
        ids, pmask = ids.to(dev), pmask.to(dev)
        pre = kvcache.KVCache(cfg, B, P, dtype, dev)
        logits = self.model(ids, position_ids=self._lib.mask_positions(pmask), attention_mask=pmask,
                            kv_cache=pre, cache_pos=0)[:, -1]
        first, version = self.version, [self.version]  # version[t]: the weights behind token t

        # 2) rows (prompt i, sample j) -> i*n + j share their prompt's KV: the decode cache holds
        #    only what each row generates, and every step reads a prompt's keys once for its n rows
        #    (kvcache.py).
        R = B * n
        cache = kvcache.KVCache(cfg, R, T, dtype, dev)
        cache.share_prefix(pre, pmask, n)
        # first new position
        logits, next_pos = logits.repeat_interleave(n, 0), pmask.sum(-1).repeat_interleave(n)

        # 3) decode: one batched forward per token over the running rows. Once finished rows are a
        #    quarter of the batch (and a few steps remain), the running rows' KV cache is gathered
        #    into a smaller batch: ~one step's cost, then each step saves the dropped rows' share
        #    (bench/generate.py). Positions and each row's uniform (below) do not depend on what the
        #    batch holds.
        toks = torch.zeros(R, T, dtype=torch.long, device=dev)    # (R, T)
        logps = torch.zeros(R, T, dtype=torch.float32, device=dev)
        stopped = torch.zeros(R, dtype=torch.bool, device=dev)
        lengths = torch.full((R,), T, dtype=torch.long, device=dev)
        # (r,) finished rows still in the batch
        done = torch.zeros(R, dtype=torch.bool, device=dev)
        for t in range(T):
            live = cache.live                                     # (r,) batch row -> completion row
            u = torch.rand(R, 1, generator=rng, device=dev)[live] if temperature > 0 else None
            tok, logp = sample(logits.float(), temperature, top_k, top_p, rng, u=u)
            toks[live, t], logps[live, t] = tok, logp
            hit = torch.isin(tok, stop) & ~done
            stopped[live[hit]] = True
            lengths[live[hit]] = t + 1
            done |= hit
            # one host sync per step (the loop needs one to know when to end)
            num_done = int(done.sum())
            if t == T - 1 or num_done == len(live):
                break
            if self.compact_finished and num_done * 4 >= len(live) and T - t > 4:
                keep = (~done).nonzero()[:, 0]
                cache.keep(keep)
                next_pos, tok, done = next_pos[keep], tok[keep], done[keep]
            # an in-flight update lands between tokens: the next forward runs the new weights over
            # the KV cache the old ones wrote (kept, not recomputed: PipelineRL's choice)
            polled()
            version.append(self.version)
            # no mask: a running row attends to all it generated (a finished row's output is never
            # read)
            logits = self.model(tok[:, None], position_ids=(next_pos + t)[:, None], kv_cache=cache,
                                cache_pos=t)[:, -1]

        # 4) one host transfer, one batched decode.
        toks, logps, lengths, stopped = (toks.tolist(), logps.tolist(), lengths.tolist(),
                                         stopped.tolist())
        seqs = [toks[r][:lengths[r]] for r in range(R)]
        texts = self._decode(seqs) if self._decode else [""] * R
        groups = [[Completion(prompt_ids=list(prompt_ids[i]), token_ids=seqs[i * n + j],
                              text=texts[i * n + j], logprobs=logps[i * n + j][:lengths[i * n + j]],
                              finish_reason="stop" if stopped[i * n + j] else "length",
                              generator_version=first,
                              versions=(version[:lengths[i * n + j]] if version[-1] != first
                                        else None),
                              metadata={"backend": "torch", "sample_index": j})
                   for j in range(n)] for i in range(B)]
        return check_completions(groups, B, n)

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int):
        # a tied lm_head.weight too
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, t in named_tensors:
            if name not in params:
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of the torch generator's model")
            params[name].copy_(t)
        self.version, self._packed = version, None

    # nothing to offload: its KV cache lives only inside generate()
    def sleep(self, keep_weights=True):
        pass

    def wake_up(self):
        pass
