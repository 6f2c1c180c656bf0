"""Config-time checks of both trainers: a bad config fails in a second, naming its field and value,
before a model, an inference engine or a process group exists.

    checks.grpo(cfg, world_size)     train_grpo.py's config (and loss_kwargs: what its loss class
                                     receives)
    checks.sft(cfg, world_size)      train_sft.py's config

Each is a table of (field, valid?, what it must be) rows, then the cross-field and outside-world
checks: the world size against the rank layout (generator ranks, tensor parallel, data-parallel
divisibility, a GPU per rank), the model path, the data source and a user's loader, the rewards, the
loss and its keyword arguments, the logging extras and the checkpoint to resume from. Nothing here
loads a model or opens a network connection: a hub name is checked for its shape only
(run.resolve_model downloads it later and fails naming it).
Left out: checks that need the model (a prompt longer than the model's context is found when the
tasks load).
"""
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import torch

import checkpoint
import config
import data
import dist
import engine
import episodes
import losses
import lora
import rewards


def fields(cfg, rules):
    """Raise for the first (field, ok, need) row whose `ok` is False; the message names the field
    and its value."""
    for name, ok, need in rules:
        if not ok:
            section, key = name.split(".")
            raise config.ConfigError(
                f"{name}={getattr(getattr(cfg, section), key)!r} must be {need}")


def optim_rules(c):
    """The rows both trainers share: dtype, optimizer, schedule, loop, timeouts, checkpoints,
    compile."""
    return [("model.dtype", c.model.dtype in ("float32", "bfloat16", "auto"),
             "float32, bfloat16 or auto"),
            ("optim.lr", c.optim.lr > 0, "> 0"), ("optim.grad_clip", c.optim.grad_clip > 0, "> 0"),
            ("optim.weight_decay", c.optim.weight_decay >= 0, ">= 0"),
            ("optim.warmup_steps", c.optim.warmup_steps >= 0, ">= 0"),
            ("optim.schedule", c.optim.schedule in ("constant", "cosine"), "constant or cosine"),
            ("optim.min_lr_ratio", 0 <= c.optim.min_lr_ratio <= 1, "in [0, 1]"),
            ("optim.betas", len(c.optim.betas) == 2 and all(0 <= b < 1 for b in c.optim.betas),
             "two values in [0, 1)"),
            ("data.max_bad_fraction", 0 <= c.data.max_bad_fraction <= 1, "in [0, 1]"),
            ("train.steps", c.train.steps >= 1, ">= 1"),
            ("train.micro_batch", c.train.micro_batch >= 1, ">= 1"),
            ("train.max_skipped_steps", c.train.max_skipped_steps >= 1, ">= 1"),
            ("dist.timeout_s", c.dist.timeout_s > 0, "> 0"),
            ("ckpt.every", c.ckpt.every >= 0, ">= 0 (0 = off)"),
            ("dist.compile", not (c.dist.compile and c.dist.tp > 1),
             f"False with dist.tp={c.dist.tp}: "
             "torch.compile of tensor-parallel (DTensor) blocks fails while tracing in torch 2.13")]


def single_turn_options(cfg):
    """Any base config takes any env, as it takes any loss: what a single-turn recipe set that
    episodes read differently is adjusted with a one-line note instead of refused."""
    ro, say = cfg.rollout, lambda msg: print("note: " + msg, file=sys.stderr)
    if ro.env and ro.overlong_cache:  # it reads one reply's length; an episode holds several
        say(f"rollout.overlong_cache={ro.overlong_cache} dropped (set to 0): DAPO's overlong "
            "shaping is single-turn (with rollout.env, rollout.max_tokens still caps each reply)")
        ro.overlong_cache = 0
    # not even one reply would fit
    if ro.env and ro.max_episode_tokens < ro.max_tokens:
        say(f"rollout.max_episode_tokens={ro.max_episode_tokens} raised to "
            f"rollout.max_turns x rollout.max_tokens = {ro.max_turns * ro.max_tokens}: an episode "
            "must fit one whole reply")
        ro.max_episode_tokens = ro.max_turns * ro.max_tokens


def grpo(cfg, world_size):
    """train_grpo.py's config, at this world size."""
    err, c = config.ConfigError, cfg
    single_turn_options(cfg)
    fields(cfg, optim_rules(c) + [
        ("data.min_digits", 1 <= c.data.min_digits <= c.data.max_digits,
         ">= 1 and <= data.max_digits"),
        ("data.max_prompt_tokens", c.data.max_prompt_tokens >= 1, ">= 1"),
        ("data.long_prompts", c.data.long_prompts in ("drop", "truncate"), "drop or truncate"),
        ("rollout.prompts_per_step", c.rollout.prompts_per_step >= 1, ">= 1"),
        ("rollout.group_size", c.rollout.group_size >= 1, ">= 1"),
        ("rollout.temperature", c.rollout.temperature > 0, "> 0"),
        ("rollout.top_p", 0 < c.rollout.top_p <= 1, "in (0, 1]"),
        ("rollout.top_k", c.rollout.top_k == -1 or c.rollout.top_k >= 1, "-1 (off) or >= 1"),
        ("rollout.max_tokens", c.rollout.max_tokens >= 1, ">= 1"),
        ("rollout.backend", c.rollout.backend in ("vllm", "torch", "auto"), "vllm, torch or auto"),
        ("rollout.kv_cache_mb", c.rollout.kv_cache_mb >= 0, ">= 0 (0: one step's worth)"),
        ("rollout.gpu_memory_utilization", 0 < c.rollout.gpu_memory_utilization <= 1, "in (0, 1]"),
        ("rollout.max_staleness", c.rollout.max_staleness >= 0,
         ">= 0 (0: on-policy; k: the generators run up to k batches ahead)"),
        ("rollout.refill_rounds", c.rollout.refill_rounds >= 0, ">= 0"),
        ("rollout.overlong_cache", 0 <= c.rollout.overlong_cache < c.rollout.max_tokens,
         ">= 0 and < rollout.max_tokens"),
        ("rollout.reward_timeout_s", c.rollout.reward_timeout_s > 0, "> 0"),
        ("rollout.reward_workers", c.rollout.reward_workers >= 0, ">= 0"),
        ("rollout.max_turns", c.rollout.max_turns >= 1, ">= 1"),
        ("rollout.max_env_chars", c.rollout.max_env_chars >= 1, ">= 1"),
        ("rollout.env_timeout_s", c.rollout.env_timeout_s > 0, "> 0"),
        ("loss.adv_eps", c.loss.adv_eps > 0, "> 0"),
        ("loss.correction_c", c.loss.correction_c > 1, "> 1 (C = 1 would cap or mask "
         "every token whose two policies differ at all)"),
        ("loss.entropy_coef", c.loss.entropy_coef >= 0, ">= 0"),
        ("distill.coef", c.distill.coef > 0, "> 0"),
        ("distill.reward_weight", c.distill.reward_weight >= 0, ">= 0 (0 = pure distillation)"),
        ("train.ppo_epochs", c.train.ppo_epochs >= 1, ">= 1"),
        ("train.minibatches", c.train.minibatches >= 1, ">= 1"),
        ("dist.tp", c.dist.tp >= 1, ">= 1"),
        ("dist.sync_interval", c.dist.sync_interval >= 1, ">= 1"),
        ("dist.sync_bucket_mb", c.dist.sync_bucket_mb >= 1, ">= 1"),
        ("eval.every", c.eval.every >= 0, ">= 0 (0 = only at start and end)"),
        ("eval.num_problems", c.eval.num_problems >= 1, ">= 1"),
        ("eval.pass_k", c.eval.pass_k >= 0, ">= 0 (0 = off)"),
        ("log.run", bool(c.log.run), "a non-empty name"),
        ("log.plot_every_s", c.log.plot_every_s >= 0 or c.log.plot_every_s == -1,
         ">= 0 (0: every step), -1 never")])
    lora_options(cfg)
    outside_world(cfg)
    rewards.reward_specs(cfg.rollout.rewards, cfg.rollout.accuracy)  # every named reward imports
    episodes.env_spec(cfg.rollout.env)  # and the env
    loss_cls = config.named(cfg.loss.name, losses.LOSSES, "loss.name", "loss")
    if cfg.loss.correction:
        config.named(cfg.loss.correction, losses.CORRECTIONS, "loss.correction", "correction")
    kw = loss_kwargs(cfg, say=lambda msg: print(msg, file=sys.stderr))
    try:
        loss_cls(**kw)
    except (TypeError, ValueError) as e:
        own = inspect.signature(loss_cls).parameters
        raise err(f"loss.kwargs: {e}"
                  + "".join(config._closest(k, own) for k in kw if k not in own)) from None
    # a correction weighs a stale sampler's tokens; it does not bound several updates per batch
    stale = ((cfg.rollout.max_staleness and not cfg.loss.correction)
             or cfg.train.ppo_epochs * cfg.train.minibatches > 1)
    if cfg.loss.name == "simple_grpo" and stale:
        # a warning, not a refusal: the loss comparison measures exactly this case
        # (scripts/compare.py)
        print("warning: loss.name='simple_grpo' ignores old logprobs (its ratio is always 1), so "
              f"with rollout.max_staleness={cfg.rollout.max_staleness}, "
              f"train.ppo_epochs={cfg.train.ppo_epochs}, train.minibatches={cfg.train.minibatches} "
              "nothing corrects for the stale policy; use 'grpo' for off-policy or multi-update "
              "training, or a loss.correction (docs/off-policy.md)", file=sys.stderr)
    config.named(cfg.loss.adv, losses.ADVANTAGES, "loss.adv", "estimator")
    # pure distillation has no group baseline: one sample per prompt is enough
    grouped = not cfg.distill.teacher or cfg.distill.reward_weight > 0
    needs_group = ("group advantages" if grouped and cfg.loss.adv in ("grpo", "dr_grpo", "rloo")
                   else "rollout.filter_zero_std" if cfg.rollout.filter_zero_std else None)
    if cfg.rollout.group_size < 2 and needs_group:
        raise err(f"rollout.group_size={cfg.rollout.group_size}: {needs_group} need at least 2 "
                  "samples")
    if cfg.distill.teacher:
        check_model_path(cfg.distill.teacher, "distill.teacher")
    if not 0 <= cfg.dist.generator_ranks < world_size:
        raise err(f"dist.generator_ranks={cfg.dist.generator_ranks} must be < world size "
                  f"{world_size} (at least one trainer rank)")
    # a GPU per rank: a trainer and a vLLM engine never share one (device_count asks NVML: CUDA
    # stays untouched)
    try:
        dist.check_gpu_layout(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
    except ValueError as e:
        raise err(f"dist.generator_ranks={cfg.dist.generator_ranks}, world size {world_size}: "
                  f"{e}") from None
    ro = cfg.rollout
    if ro.inflight_updates and not (cfg.dist.generator_ranks and ro.max_staleness):
        raise err("rollout.inflight_updates=True needs generation running while the trainers "
                  "update: dedicated generator ranks (dist.generator_ranks >= 1, not "
                  f"{cfg.dist.generator_ranks}) generating ahead (rollout.max_staleness >= 1, not "
                  f"{cfg.rollout.max_staleness})")
    num_trainers = world_size - cfg.dist.generator_ranks
    if num_trainers % cfg.dist.tp:
        raise err(f"dist.tp={cfg.dist.tp} does not divide the {num_trainers} trainer ranks")
    dp = num_trainers // cfg.dist.tp
    if cfg.rollout.prompts_per_step % dp:
        raise err(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is not divisible by "
                  f"the data-parallel size {dp}")


def lora_options(cfg):
    """model.lora_*: a rank, a scale, targets that exist; tensor parallelism is not built for
    adapted layers."""
    m, err = cfg.model, config.ConfigError
    fields(cfg, [("model.lora_rank", m.lora_rank >= 0, ">= 0 (0 = off)"),
                 ("model.lora_alpha", m.lora_alpha > 0, "> 0"),
                 ("model.lora_dropout", 0 <= m.lora_dropout < 1, "in [0, 1)")])
    if not m.lora_rank:
        return
    if not m.lora_targets:
        raise err(f"model.lora_targets is empty: name some of {', '.join(lora.TARGETS)}")
    for t in m.lora_targets:
        if t not in lora.TARGETS:
            raise err(f"model.lora_targets: no Linear '{t}' in a block"
                      f"{config._closest(t, lora.TARGETS)}; valid: {', '.join(lora.TARGETS)}")
    if cfg.dist.tp > 1:
        raise err(f"model.lora_rank={m.lora_rank} with dist.tp={cfg.dist.tp}: LoRA is not built "
                  "for tensor-parallel layers; use dist.tp=1 (FSDP2 shards the adapters)")


def loss_kwargs(cfg, say=None):
    """loss.kwargs for loss.name. A key this loss does not take but another loss does (a base
    config's GRPO `agg` under --loss.name=simple_grpo) is dropped, and `say` is told which; a key no
    loss takes is left in, so the loss's own error names it (grpo() adds the closest key this loss
    does take)."""
    cls = config.named(cfg.loss.name, losses.LOSSES, "loss.name", "loss")
    others = [set(inspect.signature(c).parameters) for c in losses.LOSSES.values()]
    own = set(inspect.signature(cls).parameters)
    kw = {k: v for k, v in cfg.loss.kwargs.items() if k in own or not any(k in t for t in others)}
    if say and (dropped := sorted(set(cfg.loss.kwargs) - set(kw))):
        say(f"note: loss.kwargs {dropped} dropped: {cls.__name__} does not take them")
    if "max_tokens" in own:
        # Dr.GRPO's constant C = generation budget
        kw.setdefault("max_tokens", cfg.rollout.max_tokens)
    return kw


def sft(cfg, world_size):
    """train_sft.py's config, at this world size."""
    c = cfg
    if world_size % c.dist.tp:
        raise config.ConfigError(f"dist.tp={c.dist.tp} does not divide the world size {world_size}")
    if c.train.batch_size % (world_size // c.dist.tp):
        raise config.ConfigError(f"train.batch_size={c.train.batch_size} is not divisible by the "
                                 f"data-parallel size {world_size // c.dist.tp}")
    fields(cfg, optim_rules(c) + [
        ("data.max_seq_tokens", c.data.max_seq_tokens >= 1, ">= 1"),
        ("data.pack_len", c.data.pack_len == 0 or c.data.pack_len >= c.data.max_seq_tokens,
         f"0 or >= data.max_seq_tokens={c.data.max_seq_tokens}"),
        ("train.batch_size", c.train.batch_size >= 1, ">= 1"),
        ("eval.num_problems", c.eval.num_problems >= 1, ">= 1"),
        ("eval.max_tokens", c.eval.max_tokens >= 1, ">= 1"),
        ("eval.stop_at_accuracy", 0 <= c.eval.stop_at_accuracy <= 1, "in [0, 1] (0 = off)")])
    lora_options(cfg)
    outside_world(cfg)


# ---- what lies outside the config: files, modules, extras ----------------------------------------
def outside_world(cfg):
    """Both trainers: the checkpoint to resume from, the data, the logging extras, the model
    path."""
    check_resume(cfg.ckpt.resume)
    check_data(cfg.data)
    check_logging(cfg.log)
    check_model_path(cfg.model.path)


def check_resume(resume):
    """"", "auto", or a complete step_<N> checkpoint directory."""
    if resume not in ("", "auto") and not (Path(resume).name.removeprefix("step_").isdigit()
                                           and checkpoint.is_complete(resume)):
        raise config.ConfigError(f"ckpt.resume={resume!r} is not a complete checkpoint (a step_<N> "
                                 "directory with a COMPLETE marker); use 'auto' for the newest "
                                 "complete one")


def _looks_local(source):
    return (source.startswith((".", "/", "~"))
            or Path(source).suffix in (".jsonl", ".json", ".parquet", ".csv"))


def check_data(d):
    """A dataset is "arith", "code", "gsm8k" or a user's loader
    "module:function" / "file.py:function" (it imports); a source that names a local file or
    directory exists (a hub name is not checked: it is downloaded when loaded)."""
    config.named(d.name, dict.fromkeys(("arith", "code", "gsm8k")), "data.name", "dataset")
    for field in ("source", "eval_source"):
        source = getattr(d, field)
        if (d.name not in ("arith", "code") and source and _looks_local(source)
                and not Path(source).exists()):
            raise config.ConfigError(f"data.{field}: no such file or directory: {source}")


def check_logging(log):
    """W&B and TensorBoard are an optional extra, pinned in requirements-extra.txt."""
    for flag in ("wandb", "tensorboard"):
        if getattr(log, flag) and importlib.util.find_spec(flag) is None:
            raise config.ConfigError(f"log.{flag}=True needs `pip install {flag}`: the optional "
                                     "extra, pinned in requirements-extra.txt (`make extras`, or "
                                     "pip install -r requirements-extra.txt)")
    netrc = Path("~/.netrc").expanduser()
    logged_in = (os.environ.get("WANDB_API_KEY")
                 or netrc.exists() and "api.wandb.ai" in netrc.read_text())
    if log.wandb and os.environ.get("WANDB_MODE") not in ("offline", "disabled") and not logged_in:
        # wandb.init would fail only after the model is loaded
        raise config.ConfigError("log.wandb=True: no W&B API key (run `wandb login` or set "
                                 "WANDB_API_KEY), or set WANDB_MODE=offline to log to files only")


def same_vocab(student, teacher):
    """Distillation scores the student's token ids under the teacher (model.path, distill.teacher:
    resolved checkpoint directories): both tokenizers must map every token to the same id, and the
    teacher's embedding must cover them."""
    a = data.Tokenizer(student).tok.get_vocab(with_added_tokens=True)
    b = data.Tokenizer(teacher).tok.get_vocab(with_added_tokens=True)
    if a != b:
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        raise config.ConfigError(
            f"distill.teacher ({teacher}) has another tokenizer than model.path ({student}): "
            f"{len(differ)} of {len(a | b)} tokens map to other ids (e.g. {differ[0]!r}: "
            f"{a.get(differ[0])} against {b.get(differ[0])}); the teacher scores the student's "
            "token ids, so both need one vocabulary")
    if (rows := engine.hf_config(teacher).vocab_size) < len(a):
        raise config.ConfigError(f"distill.teacher ({teacher}): its embedding has {rows} rows, "
                                 f"fewer than the {len(a)} tokens of model.path's tokenizer")


def check_model_path(path, field="model.path"):
    """"tiny:<dir>[@seed]", a local checkpoint (config.json), or what looks like a hub name
    ("org/name" that is not a local path; run.resolve_model downloads it and fails naming it).
    `field`: the config field it came from."""
    if not path or path == "tiny:":
        raise config.ConfigError(
            f"{field} is empty: give a checkpoint directory, a hub name or tiny:<dir>")
    looks_local = path.startswith((".", "/", "~")) or Path(path).exists() or path.count("/") != 1
    if looks_local and not path.startswith("tiny:") and not Path(path, "config.json").exists():
        raise config.ConfigError(f"{field}: no config.json in {path} (a checkpoint directory; "
                                 f"`tiny:{path}` would make a random tiny model there)")
