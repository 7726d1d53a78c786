"""The optimizer study's sweep (every unit validates; arms, seeds, steps, optimizer) and its pilot's pick rule."""
import os

import pytest

from experiments import launch, workunit
from experiments.studies.optimizer import pilot, sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "experiments", "configs", "pilot.py") + ":trace"
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
