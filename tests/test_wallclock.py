"""experiments.wallclock: time to accuracy parsed from a job log (absl lines, tqdm noise, midnight wrap)."""
import pytest

from experiments import wallclock

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
