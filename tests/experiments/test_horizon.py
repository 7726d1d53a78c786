"""experiments/studies/horizon/page.py: the horizon page's convergence check, extension rule, C2 decision, steps to sync's
level and the mechanism summary, on unit directories written as the job leaves them."""
import json
import os

import pytest

from experiments.launch import workunit
from experiments.stats import loader
from experiments.studies.horizon import mechanism as mechanism_summary, page as horizon


def _unit(root, arm, lag, seed, accs, steps_per_eval=25, moment_ratio=None, finished=True):
  """A workdir: unit.json (labels, config), metrics.jsonl with an evaluation every `steps_per_eval` steps
  (greedy accuracies `accs`, base 0.40), result.json when finished."""
  steps = steps_per_eval * len(accs)
  workdir = os.path.join(root, f"{arm}-k{lag}-s{seed}")
  os.makedirs(workdir)
  config = {"rl": {"max_lag": lag, "steps": steps}, "seed": seed}
  with open(os.path.join(workdir, workunit.RECORD), "w") as f:
    json.dump({"labels": {"arm": arm}, "config": config}, f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):
      row = {"step": step, "loss": 0.1, "ess_ratio": 0.6 if lag else 1.0}
      if moment_ratio is not None:
        row.update({"opob/moment_ratio": moment_ratio, "opob/max_weight_share": 0.5})
      if step % steps_per_eval == 0:
        row[loader.ACC] = accs[step // steps_per_eval - 1]
      f.write(json.dumps(row) + "\n")
  if finished:
    with open(os.path.join(workdir, workunit.RESULT), "w") as f:
      json.dump({"base": {loader.ACC: 0.40}, "final": {loader.ACC: accs[-1]}, "steps": steps}, f)


FLAT = [0.50, 0.60, 0.69, 0.70, 0.71, 0.70, 0.71, 0.71]          # last 3: 70.67, the 3 before: 70.0


def _runs(root):
  runs = loader.load_runs(str(root))
  return {r.name: r for r in runs}


def test_convergence_compares_the_last_three_evaluations_with_the_three_before(tmp_path):
  _unit(tmp_path, "sync", 0, 0, FLAT)
  _unit(tmp_path, "sync", 0, 1, [0.5, 0.55, 0.60, 0.62, 0.64, 0.66, 0.68, 0.70])  # 68.0 vs 62.0: rising
  _unit(tmp_path, "sync", 0, 2, FLAT[:5])                                         # too short to judge
  runs = _runs(tmp_path)
  last, before, ok = horizon.convergence(runs["sync-k0-s0"])
  assert (last, before, ok) == (pytest.approx((0.70 + 0.71 + 0.71) / 3), pytest.approx((0.69 + 0.70 + 0.71) / 3), True)
  assert horizon.convergence(runs["sync-k0-s1"])[2] is False
  assert horizon.convergence(runs["sync-k0-s2"]) is None
  sync = [runs[f"sync-k0-s{s}"] for s in range(3)]
  assert horizon.to_extend(sync, planned_steps=200) == [1]
  assert horizon.to_extend(sync, planned_steps=150) == []  # an extended run (longer than planned) is not re-checked
  table = "\n".join(horizon.convergence_table(sync, planned_steps=150))
  assert "| 1 | 150 | 64.0 | 55.0 | +9.0 | no |" in table and "| 1 | 200 | 68.0 | 62.0 | +6.0 | no |" in table


def test_c2_waits_for_extension_then_decides_by_the_margin(tmp_path):
  for seed in range(3):
    _unit(tmp_path, "sync", 0, seed, FLAT)
    _unit(tmp_path, "vcpo", 8, seed, [a - 0.01 * (seed + 1) for a in FLAT], moment_ratio=0.8)
  text = horizon.write(str(tmp_path), str(tmp_path / "out"), plots=False, planned=200, seeds=(3, 3))
  assert "vcpo@k=8 - sync@k=0: -2.0 [-4.5, +0.5] pts, n=3" in text and "**reproduced**" in text
  text = horizon.write(str(tmp_path), str(tmp_path / "out"), plots=False, planned=200, seeds=(4, 3))
  assert "**interim (3 of 4 planned seeds finished): reproduced**" in text
  runs = list(_runs(tmp_path).values())
  groups = loader.group_runs(runs)
  summaries = {r.name: loader.run_summary(r, 0.5, 0.1) for r in runs}
  find = horizon.claims.finder(groups, summaries)
  assert horizon.c2(find, pending=[1]).verdict.startswith("pending: sync has not converged for seeds [1]")
  one = lambda arm, lag: {0: find(arm, lag)[0]} if find(arm, lag) else {}  # noqa: E731
  assert horizon.c2(one, pending=[]).verdict == "not decided yet (1 paired seed; the rule needs an interval)"
  assert "| vcpo-k8-s0 | 200 | 0.800 | 0.500 | 0.600 |" in text


def test_c2_refuted_when_vcpo_is_clearly_below_sync(tmp_path):
  for seed in range(3):
    _unit(tmp_path, "sync", 0, seed, FLAT)
    _unit(tmp_path, "vcpo", 8, seed, [a - 0.10 - 0.005 * seed for a in FLAT])
  _unit(tmp_path, "seq_tis", 8, 0, FLAT[:3], finished=False)
  text = horizon.write(str(tmp_path), str(tmp_path / "out"), plots=False, planned=200, seeds=(3, 3))
  assert "**not reproduced (refuted)**" in text
  assert "| seq_tis | 8 | (step 75) |  |  | - | 0/0 |" in text
  _unit(tmp_path, "vcpo", 8, 3, FLAT[:3], finished=False)
  pytest.importorskip("matplotlib")
  text = horizon.write(str(tmp_path), str(tmp_path / "out"), plots=True, planned=200, seeds=(3, 3))
  assert "**interim (3 of 3 planned seeds finished; 1 of 7 units still running): not reproduced (refuted)**" in text
  assert all(os.path.getsize(tmp_path / "out" / f) > 1000 for f in ("accuracy.png", "curves.png"))


def test_steps_to_level_uses_the_seed_mean_curve(tmp_path):
  _unit(tmp_path, "vcpo", 8, 0, [0.50, 0.60, 0.66, 0.70])
  _unit(tmp_path, "vcpo", 8, 1, [0.50, 0.64, 0.66, 0.70])  # mean at step 50: 0.62
  runs = [r for r in _runs(tmp_path).values()]
  assert horizon.steps_to_level(runs, level=0.67) == 50     # 0.62 >= 0.67 - 0.05
  assert horizon.steps_to_level(runs, level=0.70) == 75
  assert horizon.steps_to_level(runs, level=0.80) is None


def test_mechanism_rows_average_steps_then_units(tmp_path):
  def variance_json(unit, ratios):
    path = tmp_path / "mechanism" / unit
    os.makedirs(path)
    steps = {str(s): {"batches": 8, "summary": {"ess_ratio": 0.5, "rows": {
        "normalised/tis/group_mean": {"second_moment_rel": 1.0, "signal_rel": 1.0, "cos_ref": 1.0, "snr_rel": 1.0},
        "normalised/tis/opob_reference": {"second_moment_rel": r, "signal_rel": r / 2, "cos_ref": 0.9,
                                          "snr_rel": float("nan")}}}} for s, r in zip((425, 450), ratios)}
    steps["400"] = {"error": "versions gone"}
    with open(path / "variance.json", "w") as f:
      json.dump({"steps": steps}, f)
  variance_json("vcpo-k8-s0", (0.6, 0.8))
  variance_json("vcpo-k8-s1", (0.8, 1.0))
  lines = mechanism_summary.section(str(tmp_path))
  row = next(line for line in lines if line.startswith("| normalised | tis | opob_reference"))
  # 2nd moment: unit means 0.7 and 0.9 -> 0.800 [0.800 -/+ 12.706 x 0.1]; signal half of it; SNR not measured
  assert row.startswith("| normalised | tis | opob_reference | 0.800 [-0.471, 2.071] | 0.400 [")
  assert row.endswith("| 0.900 [0.900, 0.900] | - |")
  assert mechanism_summary.section(str(tmp_path / "nothing")) == ["(not measured yet)"]
  # the answer leads the section: the VCPO row's 2nd moment, its interval straddling 1
  assert lines[0].startswith("**Answer (2 units).**")
  assert "0.800 [-0.471, 2.071] of the group mean's: not distinguishable from it" in lines[0]


def test_the_mechanism_answer_states_the_direction_and_size_by_the_interval():
  def unit_rows(vcpo, no_is, z):
    return {"normalised/tis/opob_reference": {"second_moment_rel": [vcpo], "signal_z": [z], "snr_rel": [1.0 + z]},
            "normalised/no_is/opob_reference": {"second_moment_rel": [no_is]}}
  per_unit = {}
  for u, args in {"a": (0.3, 1.8, 1.0), "b": (0.4, 1.9, 3.0), "c": (0.5, 2.0, 0.5)}.items():
    for key, metrics in unit_rows(*args).items():
      for metric, vals in metrics.items():
        per_unit.setdefault((key, metric), {})[u] = vals
  (text,) = mechanism_summary.answer(per_unit)
  # 0.4 +/- 4.303 x 0.0577 = [0.152, 0.648]; 1.9 +/- the same; SNR 2.5 +/- 4.303 x 0.764
  assert "0.400 [0.152, 0.648] of the group mean's: 60% lower (95% interval 35% to 85%)" in text
  assert "1.900 [1.652, 2.148] of the group mean's: 90% higher (95% interval 65% to 115%)" in text
  assert "resolved (signal z > 2) in 1 of 3 units (median z 1.00)" in text
  assert "2.500 [-0.786, 5.786] of the group mean's: not distinguishable from it" in text
  assert text.endswith("cannot settle.") and "opob_matched" not in text
  assert mechanism_summary.answer({}) == []


def test_a_verdict_before_the_planned_seeds_is_interim_a_failed_precondition_too(tmp_path):
  for seed in range(2):
    _unit(tmp_path, "sync", 0, seed, FLAT)
    _unit(tmp_path, "vcpo", 8, seed, FLAT)
  runs = list(_runs(tmp_path).values())
  arms = {("sync", 0), ("vcpo", 8)}
  mark = lambda text, planned: horizon.interim(  # noqa: E731
      horizon.verdicts.Verdict("C2", "rule", "numbers", text), runs, arms, planned).verdict
  assert mark("not testable here (sync did not learn)", 4) == (
      "interim (2 of 4 planned seeds finished): not testable here (sync did not learn)")
  assert mark("reproduced", 2) == "reproduced"
  assert mark("not decided yet (1 paired seed; the rule needs an interval)", 4).startswith("not decided yet")


def test_the_mechanism_rows_are_the_estimator_baselines():
  """The page's row order names every baseline experiments.studies.horizon.variance measures, and nothing else."""
  from experiments.studies.horizon import estimator_moments as em
  assert sorted(mechanism_summary.ROWS) == sorted(em.BASELINES) and mechanism_summary.ROWS[0] == "group_mean"


def test_the_c5_row_comes_from_the_wallclock_page_or_says_not_run(tmp_path):
  """C5 has its own runs and page (experiments.studies.wallclock.page writes c5.json); the horizon page carries its verdict."""
  from experiments.stats import verdicts
  for seed in range(3):
    _unit(tmp_path, "sync", 0, seed, FLAT)
  out = tmp_path / "out"
  text = horizon.write(str(tmp_path), str(out), plots=False, planned=200, seeds=(3, 3))
  assert "| C5 | " in text and "**not run yet**" in text
  c5_runs = [{"lag": lag, "seed": s, "endpoint": 0.8,
              "evals": [(t * scale, 0.5), (2 * t * scale, 0.79)]} for s, t in enumerate((100.0, 110.0, 90.0))
             for lag, scale in ((0, 1.0), (2, 0.6 + 0.01 * s), (4, 0.7))]
  v = verdicts.c5(c5_runs)
  with open(out / "c5.json", "w") as f:
    json.dump({"runs": c5_runs, "left_out": [], "verdict": v.verdict, "numbers": v.numbers}, f)
  text = horizon.write(str(tmp_path), str(out), plots=False, planned=200, seeds=(3, 3))
  row = f"| C5 | {verdicts.RULES['C5']} | {v.numbers} ([c5.md](c5.md)) | **reproduced** |"
  assert v.verdict == "reproduced" and row in text


def test_the_page_reports_vcpo_against_seq_tis_at_both_lags(tmp_path):
  for seed in range(2):
    _unit(tmp_path, "sync", 0, seed, FLAT)
    _unit(tmp_path, "vcpo", 32, seed, FLAT)
    _unit(tmp_path, "seq_tis", 32, seed, [a - 0.1 * (seed + 1) for a in FLAT])  # 10 and 20 points below
  text = horizon.write(str(tmp_path), str(tmp_path / "out"), plots=False, planned=200, seeds=(2, 2))
  assert "vcpo@k=32 - seq_tis@k=32: +15.0 [-48.5, +78.5] pts, n=2" in text
  assert "vcpo@k=8 - seq_tis@k=8: no paired seeds" in text
