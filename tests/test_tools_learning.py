"""experiments/tools_learning.py: the per-seed and over-seed numbers, the page and the figure from finished runs."""
import json

import pytest

from experiments import tools_learning

pytest.importorskip("matplotlib")


def _fake_run(workdir, base, final, calls):
  workdir.mkdir(parents=True)
  (workdir / "result.json").write_text(json.dumps({
      "base": {"eval/greedy_accuracy": base, "eval/sampled_accuracy": base / 2},
      "final": {"eval/greedy_accuracy": final, "eval/sampled_accuracy": final / 2}, "steps": 4}))
  rows = [{"step": s, "reward/mean": 0.1 * s, "tools/calls_per_episode": calls + s,
           "tools/error_rate": 0.1, "tools/turns_per_episode": 2.0} for s in range(1, 5)]
  rows[-1].update({"eval/greedy_accuracy": final, "eval/sampled_accuracy": final / 2})
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (workdir / "config.json").write_text(json.dumps({"task": {"eval_size": 256}}))
  (workdir / "timing.json").write_text(json.dumps({"minutes": 10.0, "launches": 1}))


def test_report_from_finished_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(tools_learning, "WINDOW", 2)
  for seed, (base, final) in enumerate([(0.2, 0.4), (0.3, 0.4), (0.25, 0.5)]):
    _fake_run(tmp_path / "runs" / f"seed{seed}", base, final, calls=1.0)
  out = tmp_path / "out"
  tools_learning.main([f"--root={tmp_path / 'runs'}", "--seeds=0,1,2", f"--out={out}", "--report_only",
                       "--", "--config.rl.steps=4"])
  summary = json.loads((out / "results.json").read_text())
  assert summary["eval_size"] == 256
  assert summary["seeds"]["1"]["gain_greedy_accuracy"] == pytest.approx(0.1)
  gain = summary["over_seeds"]["gain_greedy_accuracy"]
  assert gain["mean"] == pytest.approx(0.55 / 3) and gain["ci95"][0] < gain["mean"] < gain["ci95"][1]
  assert summary["seeds"]["0"]["start_calls_per_episode"] == pytest.approx(2.5)  # steps 1-2
  assert summary["seeds"]["0"]["end_calls_per_episode"] == pytest.approx(4.5)  # steps 3-4
  page = (out / "README.md").read_text()
  assert "-- --config.rl.steps=4" in page and "| 1 | 30.0 | 40.0 | +10.0 |" in page
  assert (out / "curve.png").stat().st_size > 0
