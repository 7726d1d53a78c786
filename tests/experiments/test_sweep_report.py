"""The claims analysis (collapse, ESS drop, bootstrap CIs) and its report on synthetic runs (tables, plots)."""
import json
import math
import os

import numpy as np
import pytest
from scipy import stats

from experiments.launch import workunit
from experiments.stats import analysis, loader, report
from experiments.launch.sweep import arm


def test_collapse_definition():
  steps = [0, 20, 40, 60, 80]
  assert analysis.collapse_step(steps, [0.3, 0.5, 0.2, 0.1, 0.0]) == 40   # below 0.25 from step 40 on
  assert analysis.collapse_step(steps, [0.3, 0.5, 0.2, 0.4, 0.0]) == 80   # recovered at 60: collapse at 80
  assert analysis.collapse_step(steps, [0.3, 0.5, 0.4, 0.6, 0.5]) is None
  assert analysis.collapse_step(steps, [0.3, 0.1, 0.1, 0.1, 0.1]) == 20   # below half the base


def test_ess_drop_uses_a_window_median_and_nan_counts_as_zero():
  steps = list(range(1, 11))
  assert analysis.ess_drop_step(steps, [0.9, 0.05, 0.9, 0.9, 0.9, 0.05, 0.02, 0.01, 0.03, 0.01]) == 6
  assert analysis.ess_drop_step(steps[:3], [0.9, float("nan"), float("nan")], window=2) == 2
  assert analysis.ess_drop_step(steps, [0.5] * 9 + [0.01]) is None  # a dip in the last steps is no drop
  assert analysis.ess_drop_step(steps, [0.5] * 10) is None


def test_mean_ci_and_iqm_bootstrap():
  m, h = analysis.mean_ci([1.0, 2.0, 3.0])
  assert m == 2.0 and h == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)  # t_{0.975, 2} = 4.3027
  assert math.isnan(analysis.mean_ci([1.0])[1])
  assert analysis.iqm([0, 1, 2, 3, 4, 5, 6, 100]) == pytest.approx(3.5)
  rng = np.random.default_rng(0)
  for n in range(1, 10):
    x = rng.normal(size=n)
    assert analysis.iqm(x) == pytest.approx(stats.trim_mean(x, 0.25))
  point, lo, hi = analysis.bootstrap_iqm([[0.1, 0.2, 0.3], [0.5, 0.6, 0.7]])
  assert lo <= point <= hi and (point, lo, hi) == analysis.bootstrap_iqm([[0.1, 0.2, 0.3], [0.5, 0.6, 0.7]])


def _run_on(platform: str) -> loader.Run:
  env = {"host": "vm", "cpus": 2, "platform": platform, "python": "3.11.7", "packages": {"jax": "0.10.2"}}
  record = {"launches": [{"git_sha": "e0bb5a26da00", "launcher": "local"}], "environment": env}
  return loader.Run("u", "vcpo", 8, 0, {}, record, None, {})


def test_provenance_names_every_host_its_units_ran_on():
  one = report._provenance([_run_on("Linux-a"), _run_on("Linux-a")])
  assert one == ["- git: e0bb5a26da; launcher: local", "- host vm (2 CPUs), Linux-a, Python 3.11.7", "- jax 0.10.2"]
  two = report._provenance([_run_on("Linux-b"), _run_on("Linux-a"), _run_on("Linux-b")])
  assert two[1:3] == ["- host vm (2 CPUs), Linux-b, Python 3.11.7: 2 units",
                      "- host vm (2 CPUs), Linux-a, Python 3.11.7: 1 unit"]
  assert two[3] == "- jax 0.10.2"


# ----------------------------------------------------------------------------- report on synthetic runs
def _synthetic_unit(root, arm_name, lag, seed, collapse_at=None, steps=40, eval_every=10):
  """A workdir as the job leaves it: unit.json, config.json, metrics.jsonl (ESS falls at step 5 when the run
  collapses), result.json."""
  overrides = {"rl.max_lag": lag, "rl.steps": steps, "eval_every": eval_every, "seed": seed}
  [unit] = workunit.prepare(arm(arm_name, overrides), "configs/tiny.py:emulate", str(root), validate=False)
  workunit.write_record(unit, "local", ["synthetic"])
  json.dump(unit.config, open(os.path.join(unit.workdir, workunit.JOB_CONFIG), "w"))
  acc = 0.3
  with open(os.path.join(unit.workdir, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):
      ess = 0.02 if collapse_at and step >= 5 else 0.9
      row = {"step": step, "ess_ratio": ess, "grad_norm": 1.0 + seed, "lr_scale": math.sqrt(ess),
             "throughput/step_seconds": 1.5}
      if step % eval_every == 0:
        acc = 0.0 if collapse_at and step >= collapse_at else 0.3 + 0.01 * step + 0.01 * seed
        row.update({loader.ACC: acc, loader.SAMPLED: acc / 2})
      f.write(json.dumps(row) + "\n")
  json.dump({"base": {loader.ACC: 0.3, loader.SAMPLED: 0.15}, "final": {loader.ACC: acc, loader.SAMPLED: acc / 2},
             "steps": steps}, open(os.path.join(unit.workdir, workunit.RESULT), "w"))


@pytest.fixture
def synthetic_root(tmp_path):
  root = tmp_path / "runs"
  for seed in range(3):
    _synthetic_unit(root, "sync", 0, seed)
    _synthetic_unit(root, "vcpo", 64, seed)
    _synthetic_unit(root, "seq_tis", 64, seed, collapse_at=30 if seed < 2 else None)
  return root


@pytest.mark.integration
def test_report_tables_collapse_and_lead_time(synthetic_root, tmp_path):
  text = report.write_report(str(synthetic_root), str(tmp_path / "out"), plots=False)
  assert "## Lag k = 0" in text and "## Lag k = 64" in text
  # vcpo finals: 0.70, 0.71, 0.72 -> 71.0 ± 2.5 (t interval); sync is the same curve: delta +0.0
  assert "| vcpo | 3 (3) | 71.0 ± 2.5 | +0.0 |" in text
  assert "| seq_tis | 3 (3) |" in text and "2/3 (30, 30)" in text
  assert "| seq_tis-k64-s0 | 5 | 30 | 25 |" in text
  assert "Mean lead time over 2 collapsed runs with an ESS drop: 25.0" in text
  assert "IQM final greedy acc" in text and "| vcpo | 1 | 3 |" in text


@pytest.mark.integration
def test_report_writes_plots(synthetic_root, tmp_path):
  pytest.importorskip("matplotlib")
  report.main([str(synthetic_root), "--out", str(tmp_path / "out")])
  for name in ("report.md", "curves_k0.png", "curves_k64.png", "aggregate.png"):
    assert os.path.getsize(tmp_path / "out" / name) > 1000 or name == "report.md"
