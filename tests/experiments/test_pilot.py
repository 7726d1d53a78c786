"""experiments.studies.claims.pilot: ESS, KL and endpoint numbers of one synthetic unit, and the study's time estimate."""
import json
import os

import pytest

from experiments.launch import workunit
from experiments.stats import loader, report
from experiments.studies.claims import pilot
from experiments.launch.sweep import arm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "experiments", "studies", "claims", "config.py")


def _unit(root, name, lag, lr=1e-4, steps=40, seed=0):
  overrides = {"rl.max_lag": lag, "rl.steps": steps, "eval_every": 10, "optim.learning_rate": lr, "seed": seed}
  [unit] = workunit.prepare(arm(name, overrides), CONFIG, str(root), validate=False)
  workunit.write_record(unit, "local", ["synthetic"])
  json.dump(unit.config, open(os.path.join(unit.workdir, workunit.JOB_CONFIG), "w"))
  with open(os.path.join(unit.workdir, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):
      lag_now = min(step - 1, lag)  # the ramp: 0, 1, ..., k, k, ...
      row = {"step": step, "ess_ratio": 1.0 if lag == 0 else 0.1 + 0.01 * step, "lag/max": lag_now,
             f"lag/frac_{lag}": 1.0 if lag_now == lag else 0.0, "lag/frac_1": 1.0 if lag_now == 1 else 0.0,
             "mismatch/lagged/seq_logw_mean": -0.05 * lag_now, "reward/mean": 0.5,
             "response_length/mean": 10.0, "throughput/step_seconds": 2.0}
      if step % 10 == 0:
        row[loader.ACC] = 0.2 + 0.01 * step + (0.0 if lag == 0 else -0.1) + 0.01 * seed
      f.write(json.dumps(row) + "\n")
  json.dump({"base": {loader.ACC: 0.2}, "final": {loader.ACC: 0.4}, "steps": steps},
            open(os.path.join(unit.workdir, workunit.RESULT), "w"))
  return unit


@pytest.mark.integration  # the launcher records the git commit (a git process)
def test_pilot_rows_and_table(tmp_path):
  root = tmp_path / "pilot"
  _unit(root, "sync", 0)
  _unit(root, "seq_tis", 8)
  text = pilot.write(str(root), str(tmp_path / "out"))
  rows = {r["arm"]: r for r in json.load(open(tmp_path / "out" / "pilot.json"))["units"]}
  tis = rows["seq_tis"]
  assert tis["steady_steps"] == 32  # steps 9..40 have every sample at lag 8
  assert tis["ess_median"] == pytest.approx(0.1 + 0.01 * 24.5)  # the median of steps 9..40
  assert tis["seq_kl_at_k"] == pytest.approx(0.4) and tis["seq_kl_per_lag_step"] == pytest.approx(0.05)
  assert tis["seq_kl_lag1"] == pytest.approx(0.05) and tis["k_x_seq_kl_lag1"] == pytest.approx(0.4)
  assert tis["endpoint"] == pytest.approx(0.2 + 0.3 - 0.1)  # evaluations at 20, 30, 40: mean 0.5 - 0.1
  assert tis["ess_dip_share"] == pytest.approx(1 / 32)  # step 9 only (0.19)
  assert "| 0.0001 | seq_tis | 8 | 40/40 (32) | 20.0 | 40.0 | -10.0 | no |" in text


@pytest.mark.integration
def test_report_prints_the_preregistered_verdicts(tmp_path):
  root = tmp_path / "study"
  for seed in range(3):
    _unit(root, "sync", 0, seed=seed)
    _unit(root, "no_correction", 8, seed=seed)
  text = report.write_report(str(root), str(tmp_path / "out"), plots=False)
  assert "## Pre-registered verdicts" in text
  assert "| C1 |" in text and "no_correction@k=8 - sync@k=0: -10.0" in text and "**reproduced**" in text
  assert "**not testable here (no runs)**" in text  # C2: no VCPO runs
