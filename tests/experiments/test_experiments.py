"""experiments/: sweep combinators, work units (resolve, hash, skip), scheduling, and smoke launches of two tiny
real units through the local launcher and through XManager (if installed)."""
import asyncio
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from experiments.launch import local as launch, workunit
from experiments.launch.sweep import arm, chain, fixed, name_units, parse_arg, product, seeds, sweep, zipit
from tests import xla_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEPS = os.path.join(REPO, "experiments", "studies", "claims", "sweeps")


# ------------------------------------------------------------------------------------------ combinators
def test_product_zip_chain_and_seeds():
  units = product(chain(arm("a", {"rl.max_lag": 0}), arm("b", {"rl.max_lag": 4})), seeds(2))
  assert units == [{"arm": "a", "config.rl.max_lag": 0, "config.seed": 0},
                   {"arm": "a", "config.rl.max_lag": 0, "config.seed": 1},
                   {"arm": "b", "config.rl.max_lag": 4, "config.seed": 0},
                   {"arm": "b", "config.rl.max_lag": 4, "config.seed": 1}]
  zipped = zipit(sweep("config.optim.learning_rate", [1e-4, 2e-4]), sweep("config.seed", [3, 4]))
  assert zipped == [{"config.optim.learning_rate": 1e-4, "config.seed": 3},
                    {"config.optim.learning_rate": 2e-4, "config.seed": 4}]
  with pytest.raises(ValueError, match="one length"):
    zipit(seeds(2), seeds(3))
  with pytest.raises(ValueError, match="disagree on 'config.seed'"):
    product(fixed({"seed": 1}), seeds(2))


def test_names_are_stable_when_seeds_or_lags_are_added():
  one = name_units(product(arm("vcpo", {"optim.learning_rate": 1e-4}), sweep("config.rl.max_lag", [64]),
                           seeds(1)))
  three = name_units(product(chain(arm("vcpo", {"optim.learning_rate": 1e-4}),
                                   arm("slow", {"optim.learning_rate": 1e-5})),
                             sweep("config.rl.max_lag", [16, 64]), seeds(3)))
  assert one[0]["name"] == "vcpo-k64-s0"
  assert "vcpo-k64-s0" in [u["name"] for u in three]  # lr is set by the arm: not part of the name
  with pytest.raises(ValueError, match="not unique"):
    name_units(chain(fixed({"seed": 0}, name="x"), fixed({"seed": 1}, name="x")))


def test_parse_arg_types_like_defaults():
  assert parse_arg("k=16,lags=0+4,arms=a+b", k=64, lags=[1], arms=["x"], seeds=3) == {
      "k": 16, "lags": [0, 4], "arms": ["a", "b"], "seeds": 3}
  with pytest.raises(ValueError, match="expected key=value"):
    parse_arg("nope=1", k=1)


# ------------------------------------------------------------------------------------------- work units
def test_flags_pass_strings_raw_and_resolve_like_the_job():
  flags = workunit.override_flags({"algo.policy_loss": "seq_tis", "algo.ess.enabled": False, "rl.max_lag": 64,
                                   "optim.learning_rate": 2e-5})
  assert flags[0] == "--config.algo.policy_loss=seq_tis"  # quoting would make the value '"seq_tis"'
  config = workunit.resolve_config("configs/countdown.py:emulate", flags)
  assert (config.algo.policy_loss, config.algo.ess.enabled, config.rl.max_lag, config.optim.learning_rate,
          config.rl.mode) == ("seq_tis", False, 64, 2e-5, "emulate")


def _unit(tmp_path, **overrides):
  [unit] = workunit.prepare(fixed(overrides), "configs/tiny.py:emulate", str(tmp_path), validate=False)
  return unit


def test_status_new_partial_done_conflict(tmp_path):
  unit = _unit(tmp_path, seed=3)
  assert unit.status() == "new"
  os.makedirs(unit.workdir)
  with open(os.path.join(unit.workdir, workunit.JOB_CONFIG), "w") as f:
    json.dump(unit.config, f, indent=2)  # what the job writes: the same data, other formatting
  assert unit.status() == "partial"
  open(os.path.join(unit.workdir, workunit.RESULT), "w").write("{}")
  assert unit.status() == "done"
  changed = _unit(tmp_path, seed=4)
  changed.workdir = unit.workdir
  assert changed.status() == "conflict"


def test_warm_start_key_ignores_rl_and_evaluation_fields_but_not_weight_ones(tmp_path):
  base = _unit(tmp_path)
  assert _unit(tmp_path, **{"algo.policy_loss": "seq_tis", "rl.max_lag": 0, "optim.learning_rate": 1e-5}
               ).warm_start_key == base.warm_start_key
  assert _unit(tmp_path, seed=1).warm_start_key != base.warm_start_key
  # Evaluation-only settings share the weights (the job re-evaluates them), weight settings do not.
  for field, value in (("rl.max_new_tokens", 6), ("task.eval_size", 16), ("task.eval_samples", 3)):
    assert _unit(tmp_path, **{field: value}).warm_start_key == base.warm_start_key, field
  assert _unit(tmp_path, **{"sft.steps": 7}).warm_start_key != base.warm_start_key
  assert _unit(tmp_path, **{"optim.weight_decay": 0.0}).warm_start_key != base.warm_start_key
  # Only the chosen task's options are read: another task's never change the key, the chosen one's do.
  assert base.config["task"]["name"] == "countdown"
  assert _unit(tmp_path, **{"task.options.arithmetic.max_digits": 5}).warm_start_key == base.warm_start_key
  assert _unit(tmp_path, **{"task.options.countdown.max_number": 30}).warm_start_key != base.warm_start_key


def test_a_donor_recorded_before_a_config_field_existed_still_matches(tmp_path):
  """A root launched at an older commit records configs without fields added since (here: an option of
  another task); its warm starts are still the same inputs, so they still donate."""
  base = _unit(tmp_path)
  older = json.loads(json.dumps(base.config))
  older["task"]["options"]["arithmetic"].pop("max_digits")
  older["optim"]["schedule"] = {"name": "cosine"}  # an RL-only field that differs is irrelevant too
  assert workunit.warm_start_key(older) == base.warm_start_key


@pytest.mark.integration
def test_record_has_config_hash_and_git_sha(tmp_path):
  unit = _unit(tmp_path)
  record = workunit.write_record(unit, "local", ["cmd"])
  record = workunit.write_record(unit, "local", ["cmd"])
  saved = json.load(open(os.path.join(unit.workdir, workunit.RECORD)))
  assert saved["config_hash"] == workunit.hash_dict(saved["config"]) == unit.config_hash
  assert len(saved["launches"]) == 2 and len(saved["launches"][0]["git_sha"]) == 40
  assert record == saved


@pytest.mark.parametrize("spec", ["ablation.py:seeds=1", "lag.py:seeds=1", "quick.py"])
def test_every_arm_of_the_committed_sweeps_validates(spec):
  """The job's own validate_config on every unit (a dry run: nothing is trained)."""
  units = workunit.prepare(launch.load_sweep(os.path.join(SWEEPS, spec)), "configs/countdown.py:emulate",
                           "/nonexistent")
  assert len({u.name for u in units}) == len(units) > 0


def test_ablation_has_every_arm():
  arms = {u["arm"] for u in launch.load_sweep(os.path.join(SWEEPS, "ablation.py"))}
  assert {"sync", "no_correction", "seq_tis", "token_tis", "seq_mis", "ppo_decoupled", "m2po", "gspo", "cispo",
          "ess_only", "opob_only", "vcpo", "sync_lr0.5x", "sync_lr0.25x", "sync_lr0.1x"} == arms


# ------------------------------------------------------------------------------------------- scheduling
def test_run_units_bounds_parallelism_and_waits_for_the_warm_start_donor(tmp_path):
  units = [_unit(tmp_path / str(i), **{"rl.max_lag": i}) for i in range(4)]
  donors = launch.warm_start_donors(units, units)
  assert donors[units[0].name] is None and all(donors[u.name] is units[0] for u in units[1:])
  running, peak, order = set(), [0], []

  async def start(unit, slot):
    running.add(unit.name)
    peak[0] = max(peak[0], len(running))
    order.append((unit.name, unit.has_warm_start()))
    if unit is units[0]:  # the donor produces its warm start only after a while
      await asyncio.sleep(0.3)
      os.makedirs(os.path.join(unit.workdir, "base"))
      open(os.path.join(unit.workdir, workunit.WARM_START_MARKER), "w").write("{}")
    await asyncio.sleep(0.1)
    running.discard(unit.name)
    return 0

  codes = asyncio.run(launch.run_units(units, donors, start, parallel=2, poll_s=0.02))
  assert codes == {u.name: 0 for u in units} and peak[0] == 2
  assert order[0] == (units[0].name, False) and all(has for _, has in order[1:])  # copied before start


@pytest.mark.integration  # the launcher records the git commit (a git process)
def test_warm_starts_from_another_root_are_donors_with_the_same_key(tmp_path):
  """A unit of another sweep's root with a cached warm start (and its unit.json) donates to units of this
  sweep whose warm-start inputs are equal (here: same seed, other lag), not to another seed's."""
  other = _unit(tmp_path / "other", **{"rl.max_lag": 8, "seed": 0})
  workunit.write_record(other, "local", ["cmd"])
  os.makedirs(os.path.join(other.workdir, "base"))
  open(os.path.join(other.workdir, workunit.WARM_START_MARKER), "w").write("{}")
  _unit(tmp_path / "other", **{"rl.max_lag": 4, "seed": 1})  # no warm start: never a donor
  [found] = workunit.cached_warm_starts(str(tmp_path / "other"))
  assert found.workdir == other.workdir and found.warm_start_key == other.warm_start_key
  mine = [_unit(tmp_path / "mine", **{"rl.max_lag": 2, "seed": 0}), _unit(tmp_path / "mine", **{"rl.max_lag": 2, "seed": 1})]
  donors = launch.warm_start_donors(mine + [found], mine)
  assert donors[mine[0].name].workdir == other.workdir and donors[mine[1].name] is None
  assert workunit.share_warm_start(donors[mine[0].name], mine[0]) and mine[0].has_warm_start()


def test_warm_starts_from_a_missing_root_is_refused_before_anything_is_written(tmp_path):
  args, extra = launch.parse_args(["--config=configs/tiny.py:emulate", f"--sweep={SWEEPS}/quick.py",
                                   f"--root={tmp_path / 'r'}", f"--warm_starts_from={tmp_path / 'nope'}"], "")
  with pytest.raises(ValueError, match="--warm_starts_from=.*nope.*not a directory"):
    launch.plan(args, extra, "local")
  assert not os.path.exists(tmp_path / "r")


# ------------------------------------------------------------------------------------ real smoke launches
TINY_SWEEP = '''
from experiments.launch.sweep import arm, chain, fixed, product
def get_sweep(arg=""):
  return product(chain(arm("seq_tis", {"algo.policy_loss": "seq_tis", "algo.advantage": "grpo"}), arm("vcpo")),
                 fixed({"rl.steps": 2, "rl.max_lag": 1, "eval_every": 1}))
'''


def _launch(tmp_path, module, python=sys.executable, timeout=600, extra=()):
  sweep_file = tmp_path / "tiny_sweep.py"
  sweep_file.write_text(TINY_SWEEP)
  cmd = [python, "-m", module, "--config=configs/tiny.py:emulate", f"--sweep={sweep_file}",
         f"--root={tmp_path / 'runs'}", "--parallel=2", *extra]
  # Units run as a user's would: without the suite's 8 fake devices (its compile flags kept: conftest.py).
  env = dict(os.environ, XLA_FLAGS=xla_env.xla_flags())
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _check_finished(root):
  for name in ("seq_tis-k1", "vcpo-k1"):
    unit = json.load(open(root / name / workunit.RECORD))
    job_config = json.load(open(root / name / workunit.JOB_CONFIG))
    assert workunit.hash_dict(job_config) == unit["config_hash"]  # the job ran exactly the recorded config
    assert json.load(open(root / name / workunit.RESULT))["steps"] == 2
    assert os.path.getsize(root / name / workunit.LOG) > 0
  # One warm start computed, the other copied: only one unit's log shows SFT steps.
  sft_logs = [name for name in ("seq_tis-k1", "vcpo-k1") if "sft step" in open(root / name / workunit.LOG).read()]
  assert len(sft_logs) == 1


HAVE_XMANAGER = importlib.util.find_spec("xmanager") is not None


@pytest.mark.slow
def test_local_launcher_runs_two_tiny_units_skips_them_and_xmanager_extends_them(tmp_path):
  """The local launcher runs two tiny units, a relaunch skips them, and more steps (nothing else changed) extend
  both from their last checkpoint through the XManager launcher (the same plan; the local one where XManager
  is not installed): one extension run checks both launchers' extend path and XManager's packaging."""
  first = _launch(tmp_path, "experiments.launch")
  assert first.returncode == 0, first.stdout + first.stderr
  _check_finished(tmp_path / "runs")
  again = _launch(tmp_path, "experiments.launch", timeout=120)
  assert again.returncode == 0 and "2 done, 0 to run" in again.stdout, again.stdout + again.stderr
  extender = "experiments.launch.xm_launch" if HAVE_XMANAGER else "experiments.launch"
  longer = _launch(tmp_path, extender, extra=["--", "--config.rl.steps=3"])
  assert longer.returncode == 0 and "(0 resume, 2 extend)" in longer.stdout, longer.stdout + longer.stderr
  for name in ("seq_tis-k1", "vcpo-k1"):
    unit = tmp_path / "runs" / name
    assert json.load(open(unit / workunit.RESULT))["steps"] == 3
    assert json.load(open(unit / "result_2.json"))["steps"] == 2
    steps = [json.loads(line)["step"] for line in open(unit / "metrics.jsonl") if line.strip()]
    assert 3 in steps and "resumed from checkpoint at step 2" in open(unit / workunit.LOG).read()
  if HAVE_XMANAGER:
    assert "XManager experiment" in longer.stdout
    assert os.path.getsize(tmp_path / "runs" / "xm" / "experiments.sqlite3") > 0  # metadata inside the run root
  other = _launch(tmp_path, "experiments.launch", timeout=120, extra=["--", "--config.optim.learning_rate=0.5"])
  assert other.returncode == 2 and "hold runs of a different config" in other.stderr
