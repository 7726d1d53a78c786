"""The pilot's and the powered claims study's sweeps: every unit validates, seeds per arm, priority order."""
import collections
import os

import pytest

from experiments.launch import local as launch, workunit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEPS = os.path.join(REPO, "experiments", "studies", "claims", "sweeps")
CONFIG = os.path.join(REPO, "experiments", "studies", "claims", "config.py")
C5 = os.path.join(REPO, "experiments", "studies", "wallclock", "sweep.py")  # absolute: _units joins it as is
HORIZON = os.path.join(REPO, "experiments", "studies", "horizon", "sweep.py")


def _units(spec):
  return workunit.prepare(launch.load_sweep(os.path.join(SWEEPS, spec)), CONFIG, "/nonexistent")


def test_claims_k8_arms_seeds_lags_and_steps():
  units = _units("claims_k8.py")
  seeds = collections.defaultdict(set)
  for u in units:
    c = u.config
    seeds[(u.labels["arm"], c["rl"]["max_lag"], c["rl"]["steps"])].add(c["seed"])
    assert c["task"]["eval_size"] >= 512 and c["task"]["eval_samples"] >= 4 and c["eval_every"] == 25
    assert c["rl"]["mode"] == "emulate" and c["rl"]["emulation"]["lag_model"] == "pipeline"
    assert c["rl"]["steps"] >= 3 * c["rl"]["max_lag"]
    if c["algo"]["advantage"] == "opob":
      expected = "truncated" if u.labels["arm"] == "vcpo_truncated" else "reference"
      assert c["algo"]["advantage_options"]["opob"]["is_weight"] == expected
  n = {key: len(s) for key, s in seeds.items()}
  assert n == {("sync", 0, 150): 6, ("seq_tis", 8, 150): 6, ("vcpo", 8, 150): 6, ("no_correction", 8, 150): 4,
               ("ess_only", 8, 150): 4, ("opob_only", 8, 150): 4, ("vcpo_truncated", 8, 150): 4,
               ("vcpo", 32, 150): 3, ("seq_tis", 32, 150): 3, ("sync_long", 0, 384): 3, ("vcpo", 128, 384): 3,
               ("seq_tis", 128, 384): 3}


def test_claims_k8_runs_c2_first_then_c3_then_c4():
  arms = [u.labels["arm"] for u in _units("claims_k8.py")]
  first = lambda name: arms.index(name)  # noqa: E731
  assert set(arms[:16]) == {"sync", "no_correction", "seq_tis", "vcpo"}
  assert first("ess_only") > max(i for i, a in enumerate(arms) if a == "sync")
  assert first("vcpo_truncated") > first("opob_only") and first("sync_long") > first("vcpo_truncated")


def test_pilot_units_per_learning_rate():
  units = _units("pilot.py:lrs=0.0001+0.0002,steps=40")
  got = [(u.labels["arm"], u.config["rl"]["max_lag"], u.config["optim"]["learning_rate"]) for u in units]
  assert got == [("sync", 0, 1e-4), ("no_correction", 8, 1e-4), ("seq_tis", 8, 1e-4),
                 ("sync", 0, 2e-4), ("no_correction", 8, 2e-4), ("seq_tis", 8, 2e-4)]


def test_claims_k8_without_the_k128_tier():
  units = _units("claims_k8.py:c4_lags=32,lr=0.0001")
  assert {u.labels["arm"] for u in units if u.config["rl"]["max_lag"] in (32, 128)} == {"vcpo", "seq_tis"}
  assert not any(u.labels["arm"] == "sync_long" or u.config["rl"]["max_lag"] == 128 for u in units)
  assert len(units) == 40 and all(u.config["optim"]["learning_rate"] == 1e-4 for u in units)


def test_c5_units_run_real_rollouts_with_the_server_on_another_core():
  units = _units(C5)
  got = [(u.labels["arm"], u.config["rl"]["max_lag"], u.config["seed"]) for u in units]
  assert got == [(arm, k, s) for s in range(3) for arm, k in (("sync", 0), ("vcpo", 2), ("vcpo", 4))]
  for u in units:
    c = u.config
    assert c["rl"]["mode"] == "http" and c["rollout"]["server_cpus"] == "1" and c["rl"]["steps"] == 150
    assert c["optim"]["learning_rate"] == 7e-5 and c["task"]["eval_size"] >= 512 and c["eval_every"] == 25
  # one warm start per seed, the same as the study's units of that seed (so they can donate it)
  study = {u.config["seed"]: u.warm_start_key for u in _units("claims_k8.py:lr=7e-05,c4_lags=32")}
  assert all(u.warm_start_key == study[u.config["seed"]] for u in units)


def test_claims_horizon_tiers_and_the_extension_keeps_names():
  units = _units(HORIZON)
  got = [(u.labels["arm"], u.config["rl"]["max_lag"], u.config["seed"]) for u in units]
  tier1 = [(arm, k, s) for s in range(4) for arm, k in (("sync", 0), ("vcpo", 8), ("ess_only", 8), ("seq_tis", 8))]
  tier2 = [(arm, k, s) for s in (4, 5) for arm, k in (("sync", 0), ("vcpo", 8))]
  tier3 = [(arm, 32, s) for s in range(3) for arm in ("vcpo", "seq_tis")]
  assert got == tier1 + tier2 + tier3 and {u.config["rl"]["steps"] for u in units} == {450}
  longer = _units(HORIZON + ":extend=1+3")
  assert [u.name for u in longer] == [u.name for u in units]
  assert {u.name: u.config["rl"]["steps"] for u in longer} == {
      u.name: 600 if u.config["seed"] in (1, 3) else 450 for u in units}
  for short, long in zip(units, longer):
    assert workunit.extends(short.config, long.config) == (short.config != long.config)
  short, long = units[4], longer[4]  # sync seed 1: 450 -> 600
  assert workunit.extends(short.config, long.config)
  decaying = {**short.config, "optim": {**short.config["optim"], "schedule": {"name": "cosine", "decay_steps": 0}}}
  assert not workunit.extends(decaying, {**long.config, "optim": decaying["optim"]})  # its decay reads rl.steps
  # C4 alone (tiers 1 and 3, seeds 0-3 extended): the whole sweep's names, configs and warm starts
  whole = {u.name: u for u in _units(HORIZON + ":extend=0+1+2+3")}
  c4 = _units(HORIZON + ":extend=0+1+2+3,tiers=1+3")
  assert [(u.labels["arm"], u.config["rl"]["max_lag"], u.config["seed"]) for u in c4] == tier1 + tier3
  assert all(u.config == whole[u.name].config and u.warm_start_key == whole[u.name].warm_start_key for u in c4)
  assert {u.config["rl"]["steps"] for u in c4} == {600}
  with pytest.raises(ValueError, match="tiers=1\\+4"):
    _units(HORIZON + ":tiers=1+4")
  # C5's units copy the horizon units' warm starts (--warm_starts_from): the same key per seed
  horizon = {u.config["seed"]: u.warm_start_key for u in units}
  assert all(u.warm_start_key == horizon[u.config["seed"]] for u in _units(C5))


def test_studies_rerun_on_seeds_they_never_used():
  units, other = _units(HORIZON), _units(HORIZON + ":first_seed=6,extend=6")
  assert [u.config["seed"] for u in other] == [u.config["seed"] + 6 for u in units]
  assert [u.labels for u in other] == [u.labels for u in units]
  assert not {u.name for u in other} & {u.name for u in units}
  assert {u.config["seed"] for u in other if u.config["rl"]["steps"] == 600} == {6}
  c5 = _units(C5 + ":first_seed=6,seeds=2")
  assert [u.config["seed"] for u in c5] == [6, 6, 6, 7, 7, 7]
  horizon = {u.config["seed"]: u.warm_start_key for u in other}
  assert all(u.warm_start_key == horizon[u.config["seed"]] for u in c5)
