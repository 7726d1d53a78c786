"""experiments.studies.wallclock.page: time to accuracy parsed from a job log (absl lines, tqdm noise, midnight wrap)."""
import math

import pytest

from experiments.stats import analysis
from experiments.studies.wallclock import page as wallclock

LOG = (
    "I1123 23:59:50.000000 140 train.py:58] warm start done: {'eval/greedy_accuracy': 0.3}\n"
    "I1123 23:59:55.500000 140 train.py:253] base model: greedy accuracy 0.300, sampled accuracy 0.100\n"
    "rl:  19%|##  | 19/100 [00:10<..]I1124 00:00:15.500000 140 train.py:142] step 20 eval "
    "{'eval/greedy_accuracy': 0.35, 'eval/sampled_accuracy': 0.3}\n"
    "rl: 40%I1124 00:00:35.500000 140 train.py:142] step 40 eval {'eval/greedy_accuracy': 0.5, "
    "'eval/sampled_accuracy': 0.45}\n"
    "I1124 00:00:40.000000 140 train.py:270] done: {'final': {}}\n")


def test_parse_elapsed_from_rl_start_across_midnight():
  run = wallclock.parse(LOG)
  assert [(s, t) for s, t, _ in run["evals"]] == [(20, 20.0), (40, 40.0)]
  assert run["rl_seconds"] == pytest.approx(44.5)
  assert wallclock.first_reaching(run["evals"], 0.4, "eval/greedy_accuracy") == (40, 40.0)
  assert wallclock.first_reaching(run["evals"], 0.3, "eval/sampled_accuracy") == (20, 20.0)
  assert wallclock.first_reaching(run["evals"], 0.9, "eval/greedy_accuracy") is None


def test_log_without_rl_phase_is_refused():
  with pytest.raises(ValueError, match="base model"):
    wallclock.parse("I1123 10:00:00.000000 1 train.py:45] sft step 1/200 loss 4.8\n")


def _unit(root, name, lag, seed, evals, launches=1, done="11:00"):
  """A finished unit as the launcher and the job leave it: unit.json, result.json, metrics.jsonl, log.txt."""
  import json
  import os
  d = os.path.join(root, name)
  os.makedirs(d)
  config = {"rl": {"max_lag": lag, "steps": 75}, "seed": seed}
  with open(os.path.join(d, "unit.json"), "w") as f:
    json.dump({"name": name, "labels": {"arm": name.split("-")[0]}, "config": config,
               "launches": [{}] * launches}, f)
  with open(os.path.join(d, "result.json"), "w") as f:
    json.dump({"base": {"eval/greedy_accuracy": 0.3}, "final": {}}, f)
  lines = ["I1124 10:00:00.000000 1 train.py:1] base model: greedy accuracy 0.300, sampled accuracy 0.1"]
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for step, seconds, acc in evals:  # sync waits 3 s for rollouts and learns 1 s; async waits 1 s
      phases = {"throughput/wait_seconds": 1.0 if lag else 3.0, "throughput/learn_seconds": 1.0,
                "throughput/publish_seconds": 0.0}
      if lag:  # the event loop's CPU during the update (sync's runs predate the metric here)
        phases["throughput/learn_loop_cpu_seconds"] = 0.25
      f.write(json.dumps({"step": step, "eval/greedy_accuracy": acc, **phases}) + "\n")
      lines.append(f"I1124 10:{seconds // 60:02d}:{seconds % 60:02d}.000000 1 train.py:2] step {step} eval "
                   f"{{'eval/greedy_accuracy': {acc}}}")
  with open(os.path.join(d, "log.txt"), "w") as f:
    f.write("\n".join(lines + [f"I1124 {done}:00.000000 1 train.py:3] done: {{}}"]) + "\n")


def test_c5_report_from_a_root_times_each_run_and_leaves_out_resumed_ones(tmp_path):
  root, out = tmp_path / "c5", tmp_path / "out"
  sync = [(25, 100, 0.4), (50, 200, 0.5), (75, 300, 0.5)]
  for s in range(3):
    _unit(root, f"sync-k0-s{s}", 0, s, sync)
    _unit(root, f"vcpo-k2-s{s}", 2, s, [(25, 60 + s, 0.5), (50, 120, 0.5), (75, 180, 0.5)],
          done="10:30" if s == 0 else "11:00")
  _unit(root, "vcpo-k4-s0", 4, 0, sync, launches=2)
  md = wallclock.write_c5(str(root), str(out))
  runs, left_out = wallclock.c5_runs(str(root))
  assert {r["name"] for r in runs} == {f"{a}-s{s}" for a in ("sync-k0", "vcpo-k2") for s in range(3)}
  assert left_out == ["vcpo-k4-s0 (resumed: 2 launches, so its wall clock is not one run's)"]
  sync0 = next(r for r in runs if r["name"] == "sync-k0-s0")
  assert sync0["evals"] == [(100.0, 0.4), (200.0, 0.5), (300.0, 0.5)] and sync0["endpoint"] == pytest.approx(0.4667, abs=1e-4)
  # target: sync endpoint 46.7% - 2 = 44.7%; sync reaches it at 200 s, k = 2 at 60-62 s
  assert "**Verdict: reproduced.**" in md and "target 44.7%" in md and (out / "c5.json").exists()
  # 75 steps in RL phases of 3600 s (the log's "done" line), 1800 s for vcpo-k2-s0: 150 steps/h, twice sync's
  assert "| 0 | 3 | 75.0 ± 0.0 | 1 | 3.00 | 1.00 | 0.00 | 1.33x | - |" in md  # (3 + 1) / max(3, 1)
  assert "| 2 | 3 | 100.0 ± 107.6 | 1.33 ± 1.43 | 1.00 | 1.00 | 0.00 | - | 0.25 |" in md


def test_per_seed_targets_time_each_seed_against_its_own_sync_endpoint():
  def run(lag, seed, accs):
    return {"lag": lag, "seed": seed, "endpoint": sum(accs[-3:]) / 3,
            "evals": list(zip([100.0, 200.0, 300.0, 400.0], accs))}
  # seed 1's warm start is weaker: the pooled target (~0.58) is above its sync run, its own (0.43) is not
  runs = [run(0, 0, [0.5, 0.7, 0.7, 0.7]), run(0, 1, [0.3, 0.45, 0.45, 0.45]),
          run(2, 0, [0.7, 0.7, 0.7, 0.7]), run(2, 1, [0.3, 0.3, 0.45, 0.45]), run(4, 0, [0.1, 0.1, 0.1, 0.1])]
  rows = wallclock.per_seed_target_rows(runs)
  assert rows[0] == "| seed | own target % | k=0: s to target | k=2: s to target | k=4: s to target |"
  assert rows[2:4] == ["| 0 | 68.0 | 200 | 100 | - |", "| 1 | 43.0 | 200 | 300 | no run |"]
  logs = [math.log(100 / 200), math.log(300 / 200)]
  m, lo, hi = analysis.interval(logs)
  assert rows[4] == f"- log(time k=2 / time sync): {m:+.2f} [{lo:+.2f}, {hi:+.2f}], n=2"
  assert rows[5] == "- log(time k=4 / time sync): no paired seeds"
