"""Does OPOB lower the estimator's second moment? Exact per-sequence gradients at a lag-emulation run's checkpoints.

    python -m experiments.studies.horizon.variance --workdir=W [--steps=10,20] [--batches=4] [--lag=run|max] --out=DIR

For each checkpoint step s of the run in W (its config.json gives model, task, lag k, tau and OPOB's options):
the learner's params at s and the N batches the run's next steps would train on (vcpo_jax.job.replay: the
checkpoint's prompt iterator and the sampler's past versions s-k..s-1, saved with the latest checkpoints only;
the emulator's per-prompt seeds and lag model; --lag=max samples every group from s-k), scored by the task, and
computes every sequence's exact score (vmap of grad) at the learner's params, then the estimator's moments under
each baseline and IS weight (experiments/studies/horizon/estimator_moments.py).
Writes DIR/variance.md (tables relative to the group-mean baseline), DIR/variance.png and DIR/variance.json.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from experiments.studies.horizon import estimator_moments as em
from vcpo_jax.job import replay

load_run = replay.load_run  # the run's config, model, tokenizer and task (a test swaps the task's reward)

METRICS = (("second_moment", "2nd moment"), ("trace_cov", "tr Cov"))  # labels sit in markdown tables: no "|"
SIGNAL = (("signal_rel", "signal"), ("signal_z", "z"), ("cos_ref", "cos"), ("snr_rel", "SNR"))  # cross-batch


def batch_result(params, model_cfg, batch, config, chunk: int) -> tuple[dict, dict]:
  """One batch's moments (every form x weight x baseline), ESS ratio and lag; and its gradient estimate per row
  (em.batch_means: kept in memory for the cross-batch signal, not written)."""
  import jax.numpy as jnp  # noqa: PLC0415
  from vcpo_jax.algo import vcpo  # noqa: PLC0415
  from vcpo_jax.model import transformer as M  # noqa: PLC0415
  logp_BxT = M.token_logprobs(params, model_cfg, jnp.asarray(batch.tokens_BxT), jnp.asarray(batch.mask_BxT))
  logw_B = np.asarray(vcpo.seq_log_weights(logp_BxT, jnp.asarray(batch.sampler_logp_BxT),
                                           jnp.asarray(batch.mask_BxT)))
  S_BxP = em.per_sequence_scores(params, model_cfg, batch.tokens_BxT, batch.mask_BxT, chunk)
  G_BxB = em.gram(S_BxP)
  coefs = em.coefficients(np.diag(G_BxB), batch.rewards_B, batch.group_B, batch.mask_BxT.sum(-1), logw_B,
                          tau=config.algo.tis_threshold, opob_options=dict(config.algo.advantage_options.opob))
  out = em.batch_moments(G_BxB, coefs, logw_B)
  out["mean_lag"] = float(np.mean(batch.lag_B))
  out["reward_mean"] = float(np.mean(batch.rewards_B))
  out["batch_size"] = int(G_BxB.shape[0])
  return out, em.batch_means(S_BxP, coefs)


def group_mean_row(row: str) -> str:
  form, weight, _ = row.split("/")
  return f"{form}/{weight}/group_mean"


def summarise(per_batch: list[dict], signal: dict | None = None) -> dict:
  """Means over batches: each row's moments, and each relative to the group-mean baseline of its form and weight;
  with `signal` (em.cross_batch), each row's signal ||mu||^2, its cosine with the group mean's mu, and its
  signal-to-noise ratio ||mu||^2 / (tr Cov / B) (the batch mean's noise), the first and last relative to the
  group mean's."""
  keys = [k for k in per_batch[0] if "/" in k]
  out = {"ess_ratio": float(np.mean([b["ess_ratio"] for b in per_batch])),
         "mean_lag": float(np.mean([b["mean_lag"] for b in per_batch])),
         "reward_mean": float(np.mean([b["reward_mean"] for b in per_batch])), "rows": {}}
  for key in keys:
    form, weight, _ = key.split("/")
    ref = f"{form}/{weight}/group_mean"
    row = {m: float(np.mean([b[key][m] for b in per_batch])) for m in ("second_moment", "trace_cov", "mean_grad_sq")}
    for m, _ in METRICS:  # ratio of the batch means (a ratio of sums), not a mean of per-batch ratios
      ref_m = float(np.mean([b[ref][m] for b in per_batch]))
      row[f"{m}_rel"] = row[m] / ref_m if ref_m > 0 else float("nan")  # no group has reward variance: undefined
    out["rows"][key] = row
  batch_size = float(np.mean([b.get("batch_size", np.nan) for b in per_batch]))
  for key, x in (signal or {}).items():
    row, ref = out["rows"][key], out["rows"][group_mean_row(key)]
    ref_signal = signal[group_mean_row(key)]["signal"]
    snr = lambda r, sig: sig / (r["trace_cov"] / batch_size) if r["trace_cov"] > 0 else float("nan")  # noqa: E731
    se = x.get("signal_se", float("nan"))
    row.update({"signal": x["signal"], "cos_ref": x["cos_ref"], "signal_se": se,
                "signal_z": x["signal"] / se if se > 0 else float("nan"),
                "signal_rel": x["signal"] / ref_signal if ref_signal > 0 else float("nan"),
                "snr": snr(row, x["signal"])})
    ref_snr = snr(ref, ref_signal)
    row["snr_rel"] = row["snr"] / ref_snr if ref_snr > 0 else float("nan")
  return out


def markdown(results: dict, command: str) -> str:
  steps = [s for s in results["steps"] if "summary" in results["steps"][s]]
  lines = [f"Command: `{command}`", ""]
  for s, r in results["steps"].items():
    if "error" in r:
      lines.append(f"- step {s}: skipped: {r['error']}")
    else:
      x = r["summary"]
      ref = ", ".join(f"{form} {weight} {x['rows'][f'{form}/{weight}/group_mean']['second_moment']:.4g}"
                      for form in em.FORMS for weight in em.WEIGHTS)
      lines.append(f"- step {s}: {r['batches']} batches, ESS ratio {x['ess_ratio']:.3f}, mean lag {x['mean_lag']:.2f}, "
                   f"mean reward {x['reward_mean']:.3f}; the group-mean baseline's second moment: {ref}")
  if not steps:
    return "\n".join(lines) + "\n"
  rows = list(results["steps"][steps[0]]["summary"]["rows"])
  for form in em.FORMS:
    lines += row_table(results, steps, rows, form, [(f"{m}_rel", label) for m, label in METRICS],
                       f"**{form}** (relative to the group-mean baseline with the same weight)")
  if all("signal" in results["steps"][s]["summary"]["rows"][rows[0]] for s in steps):
    for form in em.FORMS:  # cross-batch: the signal, its z, its cosine and the batch mean's signal / noise
      lines += row_table(results, steps, rows, form, SIGNAL, (
          f"**{form}: signal** (across batches; signal = the expected gradient's squared norm, SNR = signal / "
          "(tr Cov / B); both relative to the group mean's with the same weight; z = the signal over its "
          "jackknife standard error, below ~2 the signal, its SNR and its cosine are not resolved; cos = cosine "
          "with the group mean's expected gradient)"))
  return "\n".join(lines) + "\n"


def row_table(results: dict, steps: list, rows: list, form: str, columns, title: str) -> list[str]:
  """A markdown table of one form: per weight and baseline, each (summary key, label) column per step and its
  mean over steps."""
  head = ["baseline", "IS weight"] + [f"s={s} {label}" for s in steps for _, label in columns] + \
      [f"mean {label}" for _, label in columns]
  lines = ["", title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for weight in em.WEIGHTS:
    for baseline in em.BASELINES:
      key = f"{form}/{weight}/{baseline}"
      if key not in rows:
        continue
      vals = [results["steps"][s]["summary"]["rows"][key][m] for s in steps for m, _ in columns]
      means = [np.mean([results["steps"][s]["summary"]["rows"][key][m] for s in steps]) for m, _ in columns]
      lines.append("| " + " | ".join([baseline, weight] + [f"{v:.3f}" for v in vals + means]) + " |")
  return lines


def plot(results: dict, path: str) -> None:
  """Per form and metric, bars per baseline (no IS / TIS), relative to the group mean, mean over steps."""
  from experiments.stats import plots  # noqa: PLC0415
  plt = plots.pyplot()
  steps = [s for s in results["steps"] if "summary" in results["steps"][s]]
  fig, axes = plt.subplots(len(em.FORMS), len(METRICS), figsize=(11, 7), squeeze=False)
  for i, form in enumerate(em.FORMS):
    for j, (metric, label) in enumerate(METRICS):
      ax = axes[i][j]
      names = [b for b in em.BASELINES if f"{form}/tis/{b}" in results["steps"][steps[0]]["summary"]["rows"]]
      for w, weight in enumerate(em.WEIGHTS):
        vals = [np.mean([results["steps"][s]["summary"]["rows"][f"{form}/{weight}/{b}"][f"{metric}_rel"]
                         for s in steps]) for b in names]
        ax.bar(np.arange(len(names)) + (w - 0.5) * 0.38, vals, width=0.38, label=weight, color=f"C{w}")
      ax.axhline(1.0, color="k", linewidth=0.8)
      ax.set_yscale("log")
      ax.set_xticks(np.arange(len(names)), names, rotation=30, fontsize=8)
      ax.set_title(f"{label}, {form} (rel. group mean)", fontsize=9)
      ax.grid(alpha=0.3, axis="y")
  axes[0][0].legend(fontsize=8)
  fig.suptitle(f"estimator moments per baseline, mean over checkpoint steps {', '.join(map(str, steps))}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run(workdir: str, steps: list[int] | None, batches: int, lag: str, chunk: int) -> dict:
  loaded = load_run(workdir)
  config = loaded.config
  available = replay.checkpoint_steps(workdir)
  if not available:
    raise ValueError(f"{workdir}: no checkpoints under {os.path.join(workdir, 'checkpoints')}")
  for s in steps or []:
    if s not in available:
      raise ValueError(f"--steps: no checkpoint at step {s} in {workdir} (have {available})")
  results = {"workdir": os.path.abspath(workdir), "max_lag": int(config.rl.max_lag), "lag": lag,
             "tau": config.algo.tis_threshold, "opob_options": dict(config.algo.advantage_options.opob), "steps": {}}
  for s in steps or available:
    try:
      drawn = replay.replay(workdir, s, batches, lag, run=loaded)
    except LookupError as e:
      if steps:  # asked for explicitly: say so and stop
        raise
      print(f"step {s}: skipped: {e}")
      results["steps"][s] = {"error": str(e)}
      continue
    done = [batch_result(drawn.params, drawn.model_cfg, b, config, chunk) for b in drawn.batches]
    per_batch = [r for r, _ in done]
    signal = em.cross_batch([m for _, m in done], group_mean_row)
    results["steps"][s] = {"batches": len(per_batch), "per_batch": per_batch,
                           "summary": summarise(per_batch, signal)}
    print(f"step {s}: {len(per_batch)} batches, ESS ratio {results['steps'][s]['summary']['ess_ratio']:.3f}")
  return results


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--steps", default="", help="comma-separated checkpoint steps (default: every checkpoint)")
  p.add_argument("--batches", type=int, default=4)
  p.add_argument("--lag", choices=("run", "max"), default="run")
  p.add_argument("--chunk", type=int, default=32, help="sequences per vmap of grad")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  if args.batches < 1:
    raise ValueError(f"--batches must be >= 1, got {args.batches}")
  steps = [int(s) for s in args.steps.split(",") if s.strip()] or None
  results = run(args.workdir, steps, args.batches, args.lag, args.chunk)
  os.makedirs(args.out, exist_ok=True)
  command = "python -m experiments.studies.horizon.variance " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
  with open(os.path.join(args.out, "variance.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(args.out, "variance.md"), "w") as f:
    f.write(markdown(results, command))
  if any("summary" in r for r in results["steps"].values()):
    plot(results, os.path.join(args.out, "variance.png"))
  print(open(os.path.join(args.out, "variance.md")).read())


if __name__ == "__main__":
  main()
