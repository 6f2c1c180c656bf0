"""What a run logs and where: a step's metrics row (rewards, lengths, staleness, the
trainer-vs-generator `mismatch`, the update's `drift`), averaged over the data-parallel ranks, and
`RunLog`, which writes the rows to metrics.jsonl, the progress line, W&B, TensorBoard and the PNG
curves. Both trainers log through it.
"""
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as tdist

import config
import episodes
import losses
import machine
import packing


def mismatch(train_logp, gen_logp, mask):
    """Train/inference mismatch on the same tokens: mean |dlogp| and k3 KL(gen || train)."""
    keep = mask.bool()  # padding may hold anything: zero it before exp
    train_logp, gen_logp = torch.where(keep, train_logp, 0.0), torch.where(keep, gen_logp, 0.0)
    return {"mismatch/abs_diff": float(losses.masked_mean((train_logp - gen_logp).abs(), mask)),
            "mismatch/kl": float(losses.masked_mean(losses.kl_estimate(gen_logp, train_logp, "k3"),
                                                    mask))}


def rollout_stats(st, step, env, max_staleness=0):
    """A step's batch in numbers (st: train_grpo.StepData): rewards (B, G) and their accuracy part,
    response lengths (B, G), the share cut at max_tokens, of groups with no signal (and on which
    side), how stale the samples were (mean, max, and the share at each staleness
    0..max_staleness), and with an env (rollout.env) the episodes' ends."""
    r, correct, lengths, groups, batch = st.r, st.correct, st.lengths, st.groups, st.batch
    age = step - batch["version"]
    return {"rollout/reward_mean": float(r.mean()), "rollout/reward_std": float(r.std()),
            # rollout.accuracy's, whatever else is summed
            "rollout/accuracy": float((correct >= 1).float().mean()),
            "rollout/response_len": float(lengths.mean()),
            "rollout/truncated_frac": float(sum(c.finish_reason == "length"
                                                for cs in groups for c in cs) / lengths.numel()),
            "rollout/zero_std_frac": float(losses.zero_std_groups(r).float().mean()),
            # the groups the accuracy part gives no signal, by side: every sample right (learned)
            # or every sample wrong (out of reach at this temperature)
            "rollout/all_right_frac": float((correct >= 1).all(1).float().mean()),
            "rollout/all_wrong_frac": float((correct < 1).all(1).float().mean()),
            # versions between the policy that sampled and the one that trains (rollout.py)
            "rollout/staleness": float(age.float().mean()),
            "rollout/staleness_max": float(age.max()),
            **{f"rollout/staleness_{j}": float((age == j).float().mean())
               for j in range(max_staleness + 1) if max_staleness},
            **(inflight_stats(batch, step) if max_staleness else {}),
            **(episodes.stats(groups) if env else {})}


def inflight_stats(batch, step):
    """Where an in-flight update (rollout.inflight_updates) reached rows mid-sequence: the mean
    staleness of their sampled tokens, and the share of rows sampled by more than one version."""
    mask, v = batch["mask"], batch["tok_version"]
    lo = torch.where(mask > 0, v, torch.inf).amin(1)
    return {"rollout/token_staleness": float(losses.masked_mean(step - v, mask)),
            "rollout/inflight_frac": float((v.masked_fill(mask == 0, -torch.inf).amax(1) > lo)
                                           .float().mean())}


def dp_mean(row, dp_group, dp):
    """The row averaged over the data-parallel ranks: one all_reduce of one vector."""
    keys = sorted(row)
    vec = torch.tensor([row[k] for k in keys], dtype=torch.float64)
    tdist.all_reduce(vec, group=dp_group)
    return {k: float(v) / dp for k, v in zip(keys, vec)}


def drift(model, batch, logp, start_logp, cfg):
    """How far this step's update moved the policy, on the batch's own response tokens (log.drift):
    KL(pi_old || pi_new) and the share of tokens whose ratio pi_new / pi_old left PPO's [0.8, 1.2]
    in this single step, and KL(pi_old || pi_start) to the weights the run began from. The tokens
    are pi_old's samples, so k3 is unbiased."""
    mask = batch["mask"]
    keep = mask.bool()
    new = packing.no_grad_logp(model, batch, cfg.train.micro_batch, cfg.rollout.temperature).cpu()
    old, new, start = (torch.where(keep, x.cpu(), 0.0) for x in (logp, new, start_logp))
    return {"drift/kl_step": float(losses.masked_mean(losses.kl_estimate(old, new, "k3"), mask)),
            "drift/moved_frac": float(losses.masked_mean(
                ((new - old).exp() - 1).abs().gt(0.2).float(), mask)),
            "drift/kl_start": float(losses.masked_mean(losses.kl_estimate(old, start, "k3"), mask))}


class RunLog:
    """A run's outputs, written by global rank 0 (on other ranks every method is a no-op): the
    resolved config (printed, and saved as config.json), one JSON row per step in metrics.jsonl,
    other .jsonl logs (`append`), a progress bar with one readable line per step (the `shown` keys),
    the PNG curves, and when asked for W&B (`log.wandb`; files under <out>/wandb, WANDB_MODE=offline
    works offline) and TensorBoard (`log.tensorboard`; event files under <out>/tb): every row with
    the same step numbers, the resolved config attached. A fresh start empties the logs; a resume
    keeps their rows up to its checkpoint."""

    def __init__(self, cfg, out, start, is_log, shown, logs=("metrics.jsonl",)):
        self.out, self.is_log, self.shown, self.wandb, self.tb = (
            Path(out), is_log, shown, None, None)
        self.plot_every_s, self.last_plot = cfg.log.plot_every_s, time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        if is_log:
            resolved = config.to_dict(vars(cfg))
            print("config:", json.dumps(resolved))
            (self.out / "config.json").write_text(json.dumps(resolved))
            info = machine.info()
            print("machine:", json.dumps(info))
            (self.out / "machine.json").write_text(json.dumps(info))
            for log in logs:
                (self.out / log).write_text(read_log(self.out / log, start) if start else "")
            # optional extras, imported only when asked for (check_logging: they are there)
            if cfg.log.wandb:
                import wandb
                self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.log.run,
                                        dir=str(self.out), config=resolved)
            if cfg.log.tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.out / "tb"))
                self.tb.add_text("config", json.dumps(resolved, indent=2), global_step=start)
        from tqdm import tqdm
        self.bar = tqdm(total=cfg.train.steps, initial=start, disable=not is_log,
                        dynamic_ncols=True)

    def step(self, row, progress=True):
        """Append the row to metrics.jsonl (and W&B, TensorBoard); with `progress`, advance the bar
        and print."""
        if not self.is_log:
            return
        self.append("metrics.jsonl", row)
        if self.wandb:
            self.wandb.log(row, step=row["step"])
        if self.tb:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, global_step=row["step"])
        if progress:
            self.bar.update(1)
            self.write(" ".join(f"{k.split('/')[-1]}={row[k]:.4g}" for k in self.shown if k in row))

    def append(self, log, row):
        if self.is_log:
            with open(self.out / log, "a") as f:
                f.write(json.dumps(row) + "\n")

    def write(self, msg):
        if self.is_log:
            self.bar.write(msg)

    def plot(self, last=False):
        """Refresh the PNGs: at the last step, else at most every `plot_every_s` (matplotlib costs
        ~1 s a plot: every 25 steps it was a fifth of the demo's SFT time)."""
        if self.is_log and self.plot_every_s >= 0 and (
                last or time.monotonic() - self.last_plot >= self.plot_every_s):
            import plots
            plots.plot_run(self.out / "metrics.jsonl", self.out)
            self.last_plot = time.monotonic()

    def close(self):
        self.bar.close()
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()


@contextmanager
def timed(perf, key):
    """perf[key] += seconds spent in the block (the step-time breakdown, perf/*_s)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        perf[key] = perf.get(key, 0.0) + time.perf_counter() - t0


def finish_step(log, row, skipped, skipped_run, max_skipped, stat_keys, last):
    """The end of every step: log the row, say so when its optimizer step was skipped (non-finite
    loss or grad norm), refresh the plots (always after the `last` step), and abort after
    `max_skipped` skipped steps in a row: after the log, so the batch that tipped it over is on
    record. Every rank calls it (every rank must raise)."""
    stats = ", ".join(f"{k}={row[k]:.4g}" for k in stat_keys if k in row)
    log.step(row)
    if skipped:
        log.write(
            f"step {row['step']}: non-finite loss or grad norm, optimizer step skipped ({stats})")
    log.plot(last)
    if skipped_run >= max_skipped:
        raise RuntimeError(f"{skipped_run} consecutive steps (up to step {row['step']}) had a "
                           f"non-finite loss or grad norm, train.max_skipped_steps={max_skipped}: "
                           f"aborting. Last batch: {stats}")


def read_log(path, last_step):
    """A .jsonl log's rows up to `last_step` (a resume drops rows logged after its checkpoint); a
    torn last line, from a kill mid-write, is dropped too."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row["step"] <= last_step:
            rows.append(line + "\n")
    return "".join(rows)
