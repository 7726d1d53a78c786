"""Results page for a sweep root: `python -m experiments.stats.report RUN_ROOT [--out DIR]` writes DIR/report.md and
PNG plots (default DIR = RUN_ROOT/report): a table per lag and arm, curves with 95% CI bands over seeds, an
IQM aggregate with bootstrap intervals and the ESS-drop -> collapse lead time (C1)."""
from __future__ import annotations

import argparse
import collections
import datetime
import math
import os

import numpy as np

from experiments.stats import analysis, claims, loader, verdicts

# (metric, title, log scale, (lower, upper) bound of the metric: CI bands are clipped to it)
CURVES = ((loader.ACC, "held-out greedy accuracy", False, (0.0, 1.0)), ("ess_ratio", "ESS ratio (log)", True, (0.0, 1.0)),
          ("grad_norm", "gradient norm before clipping (log)", True, (0.0, None)),
          ("lag/mean", "mean policy lag of the batch (steps)", False, (0.0, None)))


def _fmt(v, spec="{:.3f}") -> str:
  return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else spec.format(v)


def _mean_of(summaries: list[dict], key: str) -> str:
  values = [x[key] for x in summaries if x.get(key) is not None]
  return _fmt(float(np.mean(values)) if values else None, "{:.3g}")


def lag_table(arms: dict[str, list[loader.Run]], summaries: dict[str, dict], references: dict[str, float]) -> list[str]:
  lines = ["| arm | seeds (done) | final greedy acc % (mean ± 95% CI) | Δ vs k=0 (pts) | final sampled acc % "
           "| min ESS ratio (worst seed) | mean lr scale | collapsed (step) | ESS drop step | RL step min "
           "| endpoint greedy acc % (last 3 evals) | median ESS ratio (mean over seeds) | share of samples at lag k |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for arm, runs in arms.items():
    s = [summaries[r.name] for r in runs]
    finals = [x["final"] for x in s if x["final"] is not None]
    ref = references.get(arm, references.get("sync"))
    delta = "-" if ref is None or not finals else f"{100 * (np.mean(finals) - ref):+.1f}"
    mins = [x["min_ess"] for x in s if x["min_ess"] is not None]
    lrs = [x["lr_scale"] for x in s if x["lr_scale"] is not None]
    collapsed = [x["collapse"] for x in s if x["collapse"] is not None]
    drops = [x["ess_drop"] for x in s if x["ess_drop"] is not None]
    minutes = [x["rl_minutes"] for x in s if x["rl_minutes"] is not None]
    lines.append(
        f"| {arm} | {len(runs)} ({sum(x['done'] for x in s)}) | {analysis.format_mean_ci(finals)} | {delta} "
        f"| {analysis.format_mean_ci([x['final_sampled'] for x in s])} | {_fmt(min(mins) if mins else None, '{:.3g}')} "
        f"| {_fmt(float(np.mean(lrs)) if lrs else None)} | {len(collapsed)}/{len(s)}"
        f"{' (' + ', '.join(map(str, collapsed)) + ')' if collapsed else ''} "
        f"| {', '.join(map(str, drops)) or '-'} | {_fmt(float(np.mean(minutes)) if minutes else None, '{:.1f}')} "
        f"| {analysis.format_mean_ci([x['endpoint'] for x in s])} | {_mean_of(s, 'median_ess')} "
        f"| {_mean_of(s, 'lag_at_k')} |")
  return lines


def aggregate_rows(groups, summaries) -> list[tuple[str, int, int, float, float, float]]:
  """Per arm over its stale runs (k > 0): (arm, lags, runs, IQM, low, high) of final accuracy in percent,
  the interval from a bootstrap that resamples seeds within each lag."""
  by_arm: dict[str, list[list[float]]] = collections.defaultdict(list)
  for lag, arms in groups.items():
    if lag == 0:
      continue
    for arm, runs in arms.items():
      finals = [summaries[r.name]["final"] for r in runs if summaries[r.name]["final"] is not None]
      if finals:
        by_arm[arm].append(finals)
  rows = []
  for arm, per_lag in sorted(by_arm.items()):
    point, lo, hi = analysis.bootstrap_iqm(per_lag)
    rows.append((arm, len(per_lag), sum(map(len, per_lag)), 100 * point, 100 * lo, 100 * hi))
  return rows


def aggregate_table(rows) -> list[str]:
  lines = ["| arm | lags | runs | IQM final greedy acc % [95% bootstrap CI] |", "|---|---|---|---|"]
  lines += [f"| {arm} | {lags} | {n} | {_fmt(p, '{:.1f}')} [{_fmt(lo, '{:.1f}')}, {_fmt(hi, '{:.1f}')}] |"
            for arm, lags, n, p, lo, hi in rows]
  return lines


def lead_table(runs: list[loader.Run], summaries) -> list[str]:
  lines = ["| unit | ESS drop step | collapse step | lead time (steps) |", "|---|---|---|---|"]
  rows = [(r, summaries[r.name]) for r in runs if summaries[r.name]["collapse"] is not None
          or summaries[r.name]["ess_drop"] is not None]
  for r, s in rows:
    lead = s["lead"] if s["lead"] is not None else ("no collapse" if s["collapse"] is None else "collapse, no ESS drop")
    lines.append(f"| {r.name} | {_fmt(s['ess_drop'], '{}')} | {_fmt(s['collapse'], '{}')} | {lead} |")
  leads = [s["lead"] for _, s in rows if s["lead"] is not None]
  if leads:
    m, h = analysis.mean_ci(leads)
    lines.append(f"\nMean lead time over {len(leads)} collapsed runs with an ESS drop: {m:.1f}"
                 + (f" ± {h:.1f} steps (95% CI)" if math.isfinite(h) else " steps (one run)"))
  elif len(lines) == 2:
    lines.append("| (no run has an ESS drop or a collapse) | | | |")
  return lines


def _task_options(task: dict) -> dict:
  """The chosen task's options from a unit's saved config (task.options.<name>; task.kwargs before the rename)."""
  return (task.get("options") or {}).get(task["name"]) or task.get("kwargs") or {}


def _settings_of(c: dict) -> dict:
  return {"rl.steps": c["rl"]["steps"], "rl.mode": c["rl"]["mode"], "rl.prompts_per_step": c["rl"]["prompts_per_step"],
          "rl.group_size": c["rl"]["group_size"], "rl.max_new_tokens": c["rl"]["max_new_tokens"],
          "task": f"{c['task']['name']} {_task_options(c['task'])}", "task.eval_size": c["task"]["eval_size"],
          "eval_every": c["eval_every"], "sft.steps": c["sft"]["steps"],
          "model": f"{c['model']['num_layers']} layers x {c['model']['hidden_size']}"}


def _settings(runs: list[loader.Run]) -> list[str]:
  """The config fields a reader needs (from the first unit); fields on which units differ are flagged."""
  first = _settings_of(runs[0].config)
  lines = [f"- `{k}`: {v}" for k, v in first.items()]
  differing = sorted({k for r in runs for k, v in _settings_of(r.config).items() if v != first[k]})
  if differing:
    lines.append(f"- NOTE: units differ in {differing}; each unit's unit.json has its resolved config")
  return lines


def _distinct(values: list[str]) -> list[str]:
  """'- value' per distinct value in first-seen order, with its unit count when they differ."""
  counts = collections.Counter(values)
  return [f"- {v}" + (f": {n} unit{'s' * (n != 1)}" if len(counts) > 1 else "") for v, n in counts.items()]


def _provenance(runs: list[loader.Run]) -> list[str]:
  launches = [r.record["launches"][-1] for r in runs if r.record.get("launches")]
  envs = [r.record["environment"] for r in runs if r.record.get("environment")]
  lines = []
  if launches:
    shas = sorted({f"{l['git_sha'][:10] if l.get('git_sha') else '?'}{'+dirty' if l.get('git_dirty') else ''}"
                   for l in launches})
    lines.append(f"- git: {', '.join(shas)}; launcher: {', '.join(sorted({l['launcher'] for l in launches}))}")
  # one line per distinct machine and package set, so units run on a changed host (a new kernel) say so
  lines += _distinct([f"host {e.get('host')} ({e.get('cpus')} CPUs), {e.get('platform')}, Python {e.get('python')}"
                      for e in envs])
  lines += _distinct([", ".join(f"{k} {v}" for k, v in sorted(e.get("packages", {}).items())) for e in envs])
  return lines


def write_page(md: list[str], out: str, name: str) -> str:
  """A page's lines joined and written to OUT/NAME (every study page ends here); returns the text."""
  text = "\n".join(md)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, name), "w") as f:
    f.write(text)
  return text


def page_parser(doc: str) -> argparse.ArgumentParser:
  """A study page's command line: --out and --no_plots; the page adds what it reads."""
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--no_plots", action="store_true")
  return p


def page_main(doc: str, write, argv=None, **options: tuple[str, str]) -> None:
  """A study page's command line over its units: UNITS, --out, --no_plots and the page's string OPTIONS
  (name=(default, help)); calls write(units, out=, plots=, **options) and says where the page went."""
  p = page_parser(doc)
  p.add_argument("units", help="the study's unit directories (a run root or its archive)")
  for name, (default, help_) in options.items():
    p.add_argument(f"--{name}", default=default, help=help_)
  a = vars(p.parse_args(argv))
  out = a.pop("out")
  write(a.pop("units"), out=out, plots=not a.pop("no_plots"), **a)
  print(f"wrote {os.path.join(out, 'results.md')}")


def write_report(root: str, out: str, *, fraction: float = analysis.COLLAPSE_FRACTION,
                 ess_threshold: float = analysis.ESS_DROP_THRESHOLD, plots: bool = True,
                 claims_metric: str = "endpoint", claims_lag: int | None = None) -> str:
  """Writes out/report.md (+ PNGs); returns the markdown. The claims section compares `claims_metric` (endpoint:
  mean of the last 3 evaluations; final: the last) at lag `claims_lag` (default: the largest)."""
  runs = loader.load_runs(root)
  if not runs:
    raise ValueError(f"no work units under {root!r} (expected <unit>/unit.json or <unit>/config.json)")
  os.makedirs(out, exist_ok=True)
  summaries = {r.name: loader.run_summary(r, fraction, ess_threshold) for r in runs}
  groups = loader.group_runs(runs)
  references = {}  # mean final accuracy of each arm's k = 0 runs
  for arm, arm_runs in groups.get(0, {}).items():
    finals = [summaries[r.name]["final"] for r in arm_runs if summaries[r.name]["final"] is not None]
    if finals:
      references[arm] = float(np.mean(finals))
  md = [f"# Results: {os.path.basename(os.path.abspath(root))}", "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by "
        f"`python -m experiments.stats.report {root}` from {len(runs)} work units "
        f"({sum(s['done'] for s in summaries.values())} finished).", "", "## Settings", "", *_settings(runs),
        *_provenance(runs), "", "## Definitions", "",
        "- Final accuracy: held-out greedy accuracy at the last step (`result.json`); mean ± 95% Student-t interval "
        "over seeds (no interval with one seed). Δ vs k=0: against the same arm's k = 0 runs, or the `sync` arm's "
        "when the arm has none. RL step min: summed step times (rollout + update, no evaluation).",
        f"- Collapse: the first evaluation step from which held-out greedy accuracy stays below {fraction:g} x the "
        "best accuracy of any earlier evaluation (base model included) until the end of the run.",
        f"- ESS drop: the first step whose ESS ratio is below {ess_threshold:g} with the median over it and the next "
        f"{analysis.ESS_DROP_WINDOW - 1} steps below it too. Lead time = collapse step - ESS drop step "
        "(resolution: the eval interval).",
        "- mean lr scale: the ESS step scale averaged over steps (1 without ESS scaling); the sync_lr* arms run "
        "sync at fixed fractions of the learning rate for comparison.", ""]
  for lag, arms in groups.items():
    md += [f"## Lag k = {lag}", "", *lag_table(arms, summaries, references), ""]
    if plots:
      name = f"curves_k{lag}.png"
      from experiments.stats import plots as plots_lib  # noqa: PLC0415  (matplotlib only when plotting)
      plots_lib.curves_figure(arms, CURVES, f"lag k = {lag}", os.path.join(out, name))
      md += [f"![curves at k = {lag}]({name})", ""]
  rows = aggregate_rows(groups, summaries)
  md += ["## Aggregate over lags k > 0", "", *aggregate_table(rows), ""]
  if plots and rows:
    from experiments.stats import plots as plots_lib  # noqa: PLC0415
    plots_lib.aggregate_figure([(a, p, lo, hi) for a, _, _, p, lo, hi in rows], os.path.join(out, "aggregate.png"))
    md += ["![aggregate](aggregate.png)", ""]
  md += ["## C1: ESS drop before collapse", "", *lead_table(runs, summaries), ""]
  claim_lines = claims.section(groups, summaries, claims_metric, claims_lag)
  if claim_lines:
    md += ["## Claims C1-C4: paired comparisons and stability", "", *claim_lines, ""]
    focus = claims.focus_arms(groups, claims_lag)
    if plots and focus:
      from experiments.stats import plots as plots_lib  # noqa: PLC0415
      k = max(groups) if claims_lag is None else claims_lag
      plots_lib.curves_figure(focus, CURVES, f"the claims' arms (stale arms at k = {k})",
                              os.path.join(out, "claims.png"))
      md += ["![the claims' arms](claims.png)", ""]
  if verdicts.K_MAIN in groups and 0 in groups:
    md += ["## Pre-registered verdicts (experiments/stats/verdicts.py)", "",
           "Endpoint = mean of the last 3 held-out greedy evaluations; differences seed-paired, 95% Student-t "
           "intervals, in points; collapse as defined above.", "",
           *verdicts.section(claims.finder(groups, summaries)), ""]
  return write_page(md, out, "report.md")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("root")
  parser.add_argument("--out", help="output directory (default ROOT/report)")
  parser.add_argument("--collapse_fraction", type=float, default=analysis.COLLAPSE_FRACTION)
  parser.add_argument("--ess_drop_threshold", type=float, default=analysis.ESS_DROP_THRESHOLD)
  parser.add_argument("--no_plots", action="store_true")
  parser.add_argument("--claims_metric", choices=sorted(claims.METRIC_TITLES), default="endpoint",
                      help="what the claims section compares (the first study's page: final)")
  parser.add_argument("--claims_lag", type=int, help="the claims section's lag (default: the largest)")
  args = parser.parse_args(argv)
  out = args.out or os.path.join(args.root, "report")
  write_report(args.root, out, fraction=args.collapse_fraction, ess_threshold=args.ess_drop_threshold,
               plots=not args.no_plots, claims_metric=args.claims_metric, claims_lag=args.claims_lag)
  print(f"wrote {os.path.join(out, 'report.md')}")


if __name__ == "__main__":
  main()
