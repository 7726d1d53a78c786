"""experiments/studies/ess_base/run.py: the per-run statistics, the page and the skip of finished runs, on fake runs."""
import json
import math

import pytest

from experiments.launch import timed_job
from experiments.studies.ess_base import run as ess_base


def _fake_run(workdir, ratios, logw_abs=0.01):
  workdir.mkdir(parents=True)
  (workdir / "result.json").write_text(json.dumps({"base": {}, "final": {}, "steps": len(ratios)}))
  rows = [{"step": 0, "eval/greedy_accuracy": 0.1}]  # an evaluation row: not an RL step
  rows += [{"step": s + 1, "ess_ratio": r, "lr_scale": math.sqrt(r), "lag/max": 0.0,
            "mismatch/lag0/seq_logw_abs_mean": logw_abs * (s + 1), "mismatch/lag0/num_seqs": 128.0,
            "mismatch/lag0/token_abs_mean": 1e-3, "response_length/mean": 10.0} for s, r in enumerate(ratios)]
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (workdir / "timing.json").write_text(json.dumps({"minutes": 2.5, "launches": 1}))


def test_report_from_finished_runs(tmp_path):
  root = tmp_path / "runs"
  _fake_run(root / "main_float32", [1.0, 1.0, 0.9999])
  _fake_run(root / "study_bfloat16", [0.99, 0.97, 0.93, 0.96, 0.90], logw_abs=0.1)
  out = tmp_path / "out"
  summary = ess_base.main([f"--root={root}", f"--out={out}", "--report_only"])
  study = summary["runs"]["study_bfloat16"]
  # By hand: sorted 0.90 0.93 0.96 0.97 0.99; p10 at position 0.4 -> 0.90 + 0.4 * 0.03.
  assert study["rl_steps"] == 5 and study["ess_ratio"]["median"] == pytest.approx(0.96)
  assert study["ess_ratio"]["p10"] == pytest.approx(0.912) and study["ess_ratio"]["min"] == pytest.approx(0.90)
  assert study["steps_below_threshold"] == 2  # 0.93 and 0.90
  assert study["scale_base1"]["min"] == pytest.approx(math.sqrt(0.90))
  assert study["seq_logw_abs_mean"]["median"] == pytest.approx(0.3)
  assert math.isnan(study["token_abs_max"]["median"])  # not logged by the fake: NaN, not an error
  assert set(summary["runs"]) == {"main_float32", "study_bfloat16"}  # the unfinished runs are left out
  assert summary["median_below_threshold"] == []
  page = (out / "README.md").read_text()
  assert f"python -m experiments.studies.ess_base.run --root={root} --out={out}" in page.split("\n", 8)[5]
  assert "| study_bfloat16 | 5 | 0.9600 | 0.9120 | 0.9000 | 4.0e-02 | 1.0e-01 | 2 |" in page
  assert ("No setting has a median lag-0 ratio below 0.95. The largest shrink from numerics alone: "
          "study_bfloat16") in page
  assert "2 of 8 steps have a ratio below 0.95." in page and f"factor 1 / {math.sqrt(0.9):.4f}," in page
  assert json.loads((out / "results.json").read_text())["runs"]["main_float32"]["ess_ratio"]["min"] == 0.9999


def test_median_below_threshold_is_named(tmp_path):
  root = tmp_path / "runs"
  _fake_run(root / "study_bfloat16", [0.9, 0.94, 0.99])
  summary = ess_base.main([f"--root={root}", f"--out={tmp_path / 'out'}", "--report_only"])
  assert summary["median_below_threshold"] == ["study_bfloat16"]
  assert "Median lag-0 ratio below 0.95 in: study_bfloat16." in (tmp_path / "out" / "README.md").read_text()


def test_finished_run_is_not_rerun(tmp_path, monkeypatch):
  _fake_run(tmp_path / "main_bfloat16", [1.0])

  def refuse(*args, **kwargs):
    raise AssertionError(f"a finished run was started again: {args}")

  monkeypatch.setattr(timed_job.subprocess, "run", refuse)
  assert ess_base.run_one(str(tmp_path), "main", "bfloat16", []) == str(tmp_path / "main_bfloat16")
  with pytest.raises(AssertionError, match="started again"):  # an unfinished one is started
    ess_base.run_one(str(tmp_path), "main", "float32", [])


def test_command_sets_dtype_and_keeps_the_settings():
  cmd = ess_base.command("study", "bfloat16", "w", ["--config.seed=3"])
  assert "--config=experiments/studies/claims/config.py:trace" in cmd and "--config.rl.max_lag=0" in cmd
  assert "--config.rl.mode=http" in cmd and "--config.model.dtype=bfloat16" in cmd
  assert cmd[-1] == "--config.seed=3" and f"--config.rl.steps={ess_base.RL_STEPS}" in cmd


def test_split_overrides_sends_what_follows_a_lone_dashdash_to_the_jobs():
  assert timed_job.split_overrides(["--root=r", "--", "--config.seed=3", "--x=1"]) == (
      ["--root=r"], ["--config.seed=3", "--x=1"])
  assert timed_job.split_overrides(["--root=r"]) == (["--root=r"], [])
  assert timed_job.split_overrides(["--", "--a=--"]) == ([], ["--a=--"])
