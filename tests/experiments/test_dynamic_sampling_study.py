"""The dynamic-sampling comparison: its sweep validates as the job would, and its page applies the pre-registered
rule (tokens counted with the dropped groups', the common budget, seed-paired effect) or says nothing has run."""
import json
import os

import pytest

from experiments.launch import local as launch, workunit
from experiments.studies.dynamic_sampling import page

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sweep_pairs_the_arms_by_seed_and_changes_only_the_filter():
  units = workunit.prepare(launch.load_sweep(os.path.join(REPO, page.SWEEP)),
                           launch.absolute_config_spec("configs/dataset.py:demo"), "/nonexistent")
  assert [(u.labels["arm"], u.config["seed"]) for u in units] == [(a, s) for s in range(3) for a in ("off", "on")]
  for u in units:
    c = u.config
    assert c["rl"]["dynamic_sampling"]["enabled"] == (u.labels["arm"] == "on")
    assert not c["rl"]["overlong"]["penalty"] and c["rl"]["steps"] == 100 and c["eval_every"] == 10
  strip = lambda c: {**c, "rl": {**c["rl"], "dynamic_sampling": None}}  # noqa: E731
  assert strip(units[0].config) == strip(units[1].config)


def _unit(root, arm, seed, accuracy, tokens_per_step, dropped_per_step=0.0, steps=40):
  d = os.path.join(root, f"{arm}-k2-s{seed}")
  os.makedirs(d)
  config = {"rl": {"max_lag": 2, "steps": steps}, "seed": seed}
  with open(os.path.join(d, "unit.json"), "w") as f:
    json.dump({"name": os.path.basename(d), "labels": {"arm": arm}, "config": config}, f)
  with open(os.path.join(d, "result.json"), "w") as f:
    json.dump({"base": {"eval/greedy_accuracy": 0.2}, "final": {}}, f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):
      row = {"step": step, "throughput/tokens": tokens_per_step, "lag/max": 2.0, "reward/zero_spread_groups": 0.0}
      if dropped_per_step:
        row.update({"dynamic_sampling/tokens_dropped_total": dropped_per_step * step,
                    "dynamic_sampling/samples_per_kept_sample": 1.5, "dynamic_sampling/prompt_drops_max": 3.0})
      if step % 10 == 0:
        row["eval/greedy_accuracy"] = accuracy(step)
      f.write(json.dumps(row) + "\n")


def test_page_compares_at_the_budget_every_run_reached(tmp_path):
  root = str(tmp_path / "root")
  for seed in range(3):
    _unit(root, "off", seed, lambda s: 0.3 + 0.002 * s, 100.0)
    # Twice the tokens per step (half of them dropped): at the off runs' 4000 tokens it has done 20 steps.
    _unit(root, "on", seed, lambda s, seed=seed: 0.3 + (0.01 + 0.001 * seed) * s, 100.0, dropped_per_step=100.0)
  summary = page.summarize(page.loader.load_runs(root))
  assert summary["budget"] == 4000.0 and summary["pairs"] == 3
  # off: mean of steps 20-40 (0.34, 0.36, 0.38); on, seed 0: only steps 10 and 20 are within 4000 tokens.
  assert summary["scores"]["0"]["off"] == pytest.approx(0.36) and summary["scores"]["0"]["on"] is None
  assert summary["verdict"] == "not enough runs"
  assert summary["arms"]["on"]["tokens_per_step"] == 200.0 and summary["arms"]["on"]["max_lag"] == 2.0


def test_page_verdict_and_skeleton(tmp_path):
  root = str(tmp_path / "root")
  for seed in range(3):
    _unit(root, "off", seed, lambda s: 0.3, 100.0, steps=60)
    _unit(root, "on", seed, lambda s, seed=seed: 0.4 + 0.01 * seed, 100.0, dropped_per_step=10.0, steps=60)
  out = str(tmp_path / "page")
  (tmp_path / "machine_time.md").write_text("| root | units |\n|---|---|\n| /runs/ds | 6 |\n")
  assert page.main([root, "--out", out, "--machine_time", str(tmp_path / "machine_time.md")]) == 0
  summary = json.load(open(os.path.join(out, "results.json")))
  assert summary["verdict"] == "pays" and summary["effect"][0] == pytest.approx(0.11)
  text = open(os.path.join(out, "README.md")).read()
  assert "**Verdict: pays**" in text and "Pre-registered rule" in text
  assert "| off | 100 | - | 0.000 | 2 (2) | - |" in text  # no filter: its counters were not measured, not 0
  assert "## Machine time" in text and "| /runs/ds | 6 |" in text
  assert "](accuracy.png)" in text and os.path.getsize(os.path.join(out, "accuracy.png")) > 1000
  with pytest.raises(SystemExit):
    page.main([root, "--out", out, "--machine_time", str(tmp_path / "absent_table")])
  assert page.main([str(tmp_path / "none"), "--out", out]) == 0
  assert "this comparison has not been run" in open(os.path.join(out, "README.md")).read()
