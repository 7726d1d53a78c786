"""The optimizer study's sweep (every unit validates; arms, seeds, steps, optimizer) and its pilot's pick rule."""
import os
import types

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments.launch import local as launch, workunit
from experiments.studies.optimizer import direction, pilot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "experiments", "studies", "claims", "config.py") + ":trace"
SWEEP = os.path.join(REPO, "experiments", "studies", "optimizer", "sweep.py")


def _units(arg):
  return workunit.prepare(launch.load_sweep(f"{SWEEP}:{arg}"), CONFIG, "/nonexistent")


def test_parts_validate_with_the_preregistered_arms_seeds_and_steps():
  pilot_units = _units("part=pilot")
  assert [u.config["optim"]["learning_rate"] for u in pilot_units] == [0.01, 0.03, 0.1, 0.3]
  assert {(u.config["seed"], u.config["rl"]["steps"], u.config["optim"]["name"], u.config["rl"]["max_lag"],
           u.config["algo"]["update_diagnostics"]) for u in pilot_units} == {(0, 100, "sgd", 0, False)}
  sgd = _units("part=sgd,lr=0.03")
  assert [u.name for u in sgd[:3]] == ["sgd_sync-k0-s0", "sgd_ess_only-k8-s0", "sgd_vcpo-k8-s0"]  # seed-major
  assert sorted({u.config["seed"] for u in sgd}) == [0, 1, 2, 3]
  for u in sgd:
    c = u.config
    assert (c["optim"]["name"], c["optim"]["momentum"], c["optim"]["learning_rate"], c["rl"]["steps"]) == \
        ("sgd", 0.9, 0.03, 300) and c["algo"]["update_diagnostics"] and c["task"]["eval_size"] == 512
    assert c["algo"]["ess"]["enabled"] == (u.labels["arm"] != "sgd_sync")
    if u.labels["arm"] == "sgd_vcpo":
      assert c["algo"]["advantage"] == "opob" and c["algo"]["advantage_options"]["opob"]["is_weight"] == "reference"
  only = _units("part=opob_only")
  assert [u.name for u in only] == [f"opob_only-k8-s{s}" for s in range(4)]
  for u in only:
    c = u.config
    assert (c["optim"]["name"], c["optim"]["learning_rate"], c["rl"]["steps"], c["algo"]["ess"]["enabled"],
            c["algo"]["advantage"], c["algo"]["advantage_options"]["opob"]["is_weight"]) == \
        ("adamw", 7e-5, 600, False, "opob", "reference")
  # Every unit of a seed shares one warm start (the optimizer is RL-only), the horizon study's too.
  assert len({u.warm_start_key for u in pilot_units + sgd + only if u.config["seed"] == 0}) == 1
  assert _units("part=sgd,lr=0.03,first_seed=6")[0].name == "sgd_sync-k0-s6"
  with pytest.raises(ValueError, match="lr="):
    _units("part=sgd")
  with pytest.raises(ValueError, match="part="):
    _units("part=adam")


def _row(lr, score, excluded=""):
  return {"name": f"u{lr}", "lr": lr, "score": score, "excluded": excluded, "acc": {}}


def test_pilot_pick_best_score_ties_to_smaller_lr_and_extends_once_at_an_edge():
  grid = [_row(0.01, 0.5), _row(0.03, 0.7), _row(0.1, 0.7), _row(0.3, 0.9, "collapsed at step 75")]
  assert pilot.pick(grid, extended=False) == ("lr", 0.03)
  grid[0]["score"] = 0.8
  assert pilot.pick(grid, extended=False) == ("extend", pilot.EXTEND_BELOW)
  assert pilot.pick(grid + [_row(0.003, 0.6)], extended=True) == ("lr", 0.01)
  top = [_row(0.01, 0.1), _row(0.03, 0.2), _row(0.1, 0.3), _row(0.3, 0.4)]
  assert pilot.pick(top, extended=False) == ("extend", pilot.EXTEND_ABOVE)
  assert pilot.pick([_row(0.1, None, "not finished")], extended=False) == ("none", None)


def _unit(root, name, arm, lag, seed, acc, *, lr=0.03, optim="sgd", finished=True, diagnostics=None):
  """A unit directory as the launcher and the job leave it: unit.json, config.json, metrics.jsonl, result.json."""
  import json  # noqa: PLC0415
  d = root / name
  d.mkdir()
  config = {"rl": {"max_lag": lag, "steps": max(acc)}, "seed": seed, "optim": {"learning_rate": lr, "name": optim}}
  (d / "unit.json").write_text(json.dumps({"labels": {"arm": arm}, "config": config}))
  (d / "config.json").write_text(json.dumps(config))
  rows = [{"step": s, "eval/greedy_accuracy": a} for s, a in sorted(acc.items()) if s > 0]
  rows += [{"step": s, **{k: v[i] for k, v in (diagnostics or {}).items()}} for i, s in enumerate((1, 2, 3))
           if diagnostics]
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  if finished:
    (d / "result.json").write_text(json.dumps({"base": {"eval/greedy_accuracy": acc[0]},
                                               "final": {"eval/greedy_accuracy": acc[max(acc)]}, "steps": max(acc)}))


def test_results_apply_the_rules_and_tabulate_pilot_and_diagnostics(tmp_path):
  import numpy as np  # noqa: PLC0415
  from experiments.stats import analysis  # noqa: PLC0415
  from experiments.studies.optimizer import results  # noqa: PLC0415
  units, theirs = tmp_path / "units", tmp_path / "horizon"
  units.mkdir()
  theirs.mkdir()
  for lr, top in ((0.01, 0.5), (0.03, 0.6), (0.1, 0.55), (0.3, 0.05)):
    _unit(units, f"pilot_sgd_sync-k0-s0-lr{lr:g}", "pilot_sgd_sync", 0, 0,
          {0: 0.4, 25: top, 50: top, 75: top, 100: top}, lr=lr)
  gaps = {0: 0.05, 1: 0.08, 2: 0.06}  # sgd_vcpo - sgd_ess_only per seed
  diag = {"update/norm": [1.0, 1.0, 1.0], "update/group_mean_norm": [2.0, 2.0, 4.0],
          "grad_norm": [1.0, 1.0, 1.0], "grad/group_mean_norm": [2.0, 2.0, 2.0],
          "update/cos_group_mean": [0.9, 0.8, 0.7], "grad/cos_group_mean": [0.9, 0.9, 0.9]}
  for s, gap in gaps.items():
    evals = lambda end: {0: 0.4, 100: end - 0.1, 200: end, 250: end, 275: end, 300: end}  # noqa: E731
    _unit(units, f"sgd_sync-k0-s{s}", "sgd_sync", 0, s, evals(0.7 + 0.01 * s))
    _unit(units, f"sgd_ess_only-k8-s{s}", "sgd_ess_only", 8, s, evals(0.6))
    _unit(units, f"sgd_vcpo-k8-s{s}", "sgd_vcpo", 8, s, evals(0.6 + gap), diagnostics=diag)
  _unit(units, "sgd_vcpo-k8-s3", "sgd_vcpo", 8, 3, {0: 0.4, 25: 0.5}, finished=False)
  results.main([str(units), "--horizon", str(theirs), "--out", str(tmp_path / "out"), "--no_plots"])  # the CLI
  text = (tmp_path / "out" / "results.md").read_text()
  m, lo, hi = analysis.interval([100 * g for g in gaps.values()])
  assert f"+{m:.1f} [+{lo:.1f}, +{hi:.1f}] pts, n=3" in text and lo > 0
  assert "interim (3 of 4 planned seeds finished; 1 of 10 units still running): OPOB helps under SGD" in text
  assert "Pick: **lr 0.03**." in text and "collapsed at step" in text  # lr 0.3 falls below half its base
  row = next(line for line in text.splitlines() if line.startswith("| sgd_vcpo | 8 | sgd | 3 |"))
  # Each run's median over steps of the norm ratios (1/2, 1/2, 1/4) and cosines, then the mean over runs.
  assert [c.split(" [")[0] for c in row.split(" | ")[4:10]] == ["1", "1", "0.5", "0.5", "0.8", "0.9"]
  assert "not testable here (no runs)" in text  # C3 without the horizon units or OPOB-only
  assert np.isclose(m, 100 * np.mean(list(gaps.values())))


def test_pilot_command_asks_for_the_extension_once_then_picks(tmp_path, capsys):
  """What run.sh reads: exit 3 and 'extend <lr>' for an edge pick of the planned grid, then exit 0 and the pick."""
  for lr, top in ((0.01, 0.7), (0.03, 0.6), (0.1, 0.55), (0.3, 0.5)):
    _unit(tmp_path, f"pilot_sgd_sync-k0-s0-lr{lr:g}", "pilot_sgd_sync", 0, 0,
          {0: 0.4, 25: top, 50: top, 75: top, 100: top}, lr=lr)
  assert pilot.main([str(tmp_path)]) == 3 and capsys.readouterr().out.strip() == "extend 0.003"
  _unit(tmp_path, "pilot_sgd_sync-k0-s0-lr0.003", "pilot_sgd_sync", 0, 0,
        {0: 0.4, 25: 0.8, 50: 0.8, 75: 0.8, 100: 0.8}, lr=0.003)
  assert pilot.main([str(tmp_path)]) == 0 and capsys.readouterr().out.strip() == "lr 0.003"


def _stub_python(tmp_path, pick_out: str, pick_code: int, launch_code: int = 0):
  """A stand-in interpreter for run.sh's order of work: logs each module it is asked to run, answers the pick."""
  log = tmp_path / "calls.txt"
  stub = tmp_path / "py"
  stub.write_text(f"""#!/usr/bin/env bash
echo "$2 $4" >> {log}
if [ "$2" = experiments.studies.optimizer.pilot ]; then echo "{pick_out}"; exit {pick_code}; fi
exit {launch_code}
""")
  stub.chmod(0o755)
  return stub, log


def _run_sh(stub, root):
  import subprocess  # noqa: PLC0415
  return subprocess.run(["bash", os.path.join(REPO, "experiments", "studies", "optimizer", "run.sh"), str(root)],
                        env={**os.environ, "PY": str(stub)}, capture_output=True, text=True, timeout=60)


@pytest.mark.integration
def test_run_sh_orders_the_parts_keeps_its_pick_and_stops_when_a_launch_is_stopped(tmp_path):
  stub, log = _stub_python(tmp_path, "lr 0.03", 0)
  root = tmp_path / "root"
  assert _run_sh(stub, root).returncode == 0
  sweeps = [line.split(":", 1)[1] for line in log.read_text().splitlines() if "--sweep" in line]
  assert sweeps == ["part=pilot,first_seed=0", "part=sgd,lr=0.03,first_seed=0", "part=opob_only,first_seed=0"]
  assert (root / "pilot_lr.txt").read_text().strip() == "0.03"
  log.unlink()
  assert _run_sh(stub, root).returncode == 0  # a relaunch keeps the pick: no pilot, no new pick
  assert [line.split(":", 1)[1] for line in log.read_text().splitlines()] == [
      "part=sgd,lr=0.03,first_seed=0", "part=opob_only,first_seed=0"]
  (tmp_path / "stopped").mkdir()
  stopped, log = _stub_python(tmp_path / "stopped", "lr 0.1", 0, 130)
  result = _run_sh(stopped, tmp_path / "root2")
  assert result.returncode == 130 and not (tmp_path / "root2" / "pilot_lr.txt").exists()
  assert len(log.read_text().splitlines()) == 1  # the stopped pilot launch, then nothing


def test_the_direction_slope_is_ols_with_one_intercept_per_arm_in_float64():
  rng = np.random.default_rng(0)
  arm = np.array(["a"] * 4 + ["b"] * 5)
  x = rng.uniform(0.1, 0.3, 9)
  y = np.where(arm == "a", 0.02, -0.05) - 0.4 * x + rng.normal(0, 0.01, 9)
  slope, lo, hi, dof = direction.within_slope(arm, x, y)
  # The same fit from the full design matrix (two arm dummies and x), its textbook covariance.
  X = np.stack([(arm == "a").astype(float), (arm == "b").astype(float), x], 1)
  beta, rss, *_ = np.linalg.lstsq(X, y, rcond=None)
  se = np.sqrt(rss[0] / (9 - 3) * np.linalg.inv(X.T @ X)[2, 2])
  assert dof == 6 and np.isclose(slope, beta[2], rtol=1e-12)
  assert np.isclose(hi - slope, scipy_stats.t.ppf(0.975, 6) * se, rtol=1e-10) and np.isclose(slope - lo, hi - slope)
  assert hi < 0 and direction.verdict((slope, lo, hi, dof)) == "a larger turn goes with a worse endpoint"
  assert direction.within_slope(["a", "a", "b"], [0.1, 0.2, 0.3], [1, 2, 3]) is None  # no residual dof
  assert direction.within_slope(["a", "a", "a", "a"], [0.2] * 4, [1, 2, 3, 4]) is None  # no spread in x
  assert direction.verdict(None).startswith("not enough runs")


def _run(name, seed, cos=()):
  return types.SimpleNamespace(name=name, seed=seed, series={direction.COS: dict(enumerate(cos))})


def test_direction_points_pair_each_opob_run_with_its_seeds_group_mean_twin():
  runs = [_run("v0", 0, [0.7, 0.8, 0.9]), _run("v1", 1, [0.6]), _run("v2", 2, [0.5]),  # sgd_vcpo
          _run("e0", 0), _run("e1", 1), _run("o0", 0, [0.9]), _run("t0", 0)]
  groups = {8: {"sgd_vcpo": runs[:3], "sgd_ess_only": runs[3:5], "opob_only": [runs[5]], "seq_tis": [runs[6]]}}
  ends = {"v0": 0.5, "v1": 0.4, "v2": 0.9, "e0": 0.45, "e1": 0.5, "o0": 0.7, "t0": 0.6}
  summaries = {n: {"done": n != "e1", "endpoint": e} for n, e in ends.items()}  # e1 unfinished: v1 has no twin
  pts = direction.points(groups, summaries)
  assert [(p["arm"], p["seed"]) for p in pts] == [("sgd_vcpo", 0), ("opob_only", 0)]  # v2: no twin on seed 2
  assert np.isclose(pts[0]["turn"], 0.2) and np.isclose(pts[0]["effect"], 0.05)
  assert np.isclose(pts[1]["turn"], 0.1) and np.isclose(pts[1]["effect"], 0.1)
  assert "not enough runs" in "\n".join(direction.section(groups, summaries))
