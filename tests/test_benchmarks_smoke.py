"""Benchmark harness: statistics, goal checks, table rendering and failure isolation of figure subprocesses."""
import json
import textwrap

import numpy as np
import pytest

from benchmarks.common import environment
from benchmarks.common import goals
from benchmarks.common import markdown
from benchmarks.common import model_choice
from benchmarks.common import records
from benchmarks.cpu import run
from benchmarks.common import summary
from benchmarks.common import timing


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_summarize_matches_numpy(n):
  samples = np.random.default_rng(n).exponential(1.0, n).tolist()
  st = summary.summarize(samples)
  assert st.median == pytest.approx(float(np.median(samples)))
  assert (st.min, st.max, st.n) == (min(samples), max(samples), n)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_summarize_rejects_bad_samples(bad):
  with pytest.raises(ValueError, match="samples"):
    summary.summarize(bad)


def test_ratio_samples_pairs_rounds():
  assert summary.ratio_samples([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
  with pytest.raises(ValueError, match="num and den"):
    summary.ratio_samples([1.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="den"):
    summary.ratio_samples([1.0], [0.0])


@pytest.mark.parametrize("value,goal,met", [
    (1.2, "<= 1.3", True), (1.3, "<= 1.3", True), (1.31, "<= 1.3", False), (0.01, "< 0.01", False),
    (4.0, ">= 4", True), (3.99, ">= 4", False), (2.0, "> 1.5", True), (None, ">= 4", None), (1.0, None, None),
    (float("nan"), ">= 1", None)])
def test_goal_met(value, goal, met):
  assert goals.goal_met(value, goal) is met


@pytest.mark.parametrize("goal", ["about 3", "=> 3", "<= x"])
def test_goal_met_rejects_malformed_goal(goal):
  with pytest.raises(ValueError, match="goal"):
    goals.goal_met(1.0, goal)


def test_time_calls_interleaves_rounds_after_warmup():
  log = []
  fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
  times = timing.time_calls(fns, warmup=2, repeats=3, sync=lambda x: x)
  assert log == ["a", "b"] * 5
  assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
  assert all(t >= 0 for v in times.values() for t in v)
  with pytest.raises(ValueError, match="repeats"):
    timing.time_calls(fns, repeats=0)


def test_time_once_waits_for_jax_results():
  import jax
  import jax.numpy as jnp
  x = jnp.ones((256, 256))
  seconds = timing.time_once(lambda: jax.jit(lambda a: a @ a)(x))
  assert seconds > 0


def _results(figures):
  return {"environment": {"date_utc": "2026-01-01 00:00:00 UTC", "cpu_model": "Test CPU", "cpu_cores": 2,
                          "platform": "linux", "backend": "cpu", "devices": "1 x cpu", "python": "3.x",
                          "versions": {"jax": "0.0"}},
          "mode": "full", "figures": figures}


def test_render_markdown_rows_values_and_errors():
  ok = records.figure("a", "step ratio | vcpo/grpo", unit="x", goal="<= 1.3",
                      stats=summary.summarize([1.1, 1.25, 1.4]), details={"B": 64})
  bad = records.failed_figure("b", "async steps/hour", "train loop missing", goal=">= 1.5")
  share = records.figure("c", "arith share", unit="%", goal="< 0.01", stats=summary.summarize([0.002, 0.004]))
  md = markdown.render_markdown(_results([ok, bad, share]))
  rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
  assert len(rows) == 4  # header + one per figure
  assert "step ratio \\| vcpo/grpo" in rows[1] and "1.25x" in rows[1] and "1.10x - 1.40x" in rows[1]
  assert "| yes |" in rows[1]
  assert "not measured" in rows[2] and "train loop missing" in rows[2]
  assert "0.30%" in rows[3] and "| < 1.00% | yes |" in rows[3]
  assert "| <= 1.30x |" in rows[1]
  assert "Test CPU" in md and "backend: cpu" in md and '"B": 64' in md


def test_write_results_records_json_and_a_page_with_the_command_under_its_title(tmp_path, capsys):
  fig = records.figure("a", "publish s", unit="s", stats=summary.summarize([0.5, 0.7]))
  results = {**_results([fig]), "command": "python -m benchmarks.cpu.bench_x --shape=tiny"}
  out = str(tmp_path / "sub" / "results-x")
  text = records.write_results(results, out, "Cost of x", ["## Extra\n\nsection body"])
  with open(out + ".json") as f:
    assert json.load(f)["command"] == results["command"]
  with open(out + ".md") as f:
    assert f.read() == text
  assert text.startswith("# Cost of x\n\n`python -m benchmarks.cpu.bench_x --shape=tiny`\n")
  assert "section body" in text and text in capsys.readouterr().out


def test_figure_goal_reflects_median():
  fig = records.figure("x", "t", unit="x", goal=">= 4", stats=summary.summarize([3.0, 3.5, 5.0]))
  assert fig["value"] == 3.5 and fig["goal_met"] is False


def test_run_figure_turns_exceptions_into_error_figures():
  def boom():
    raise RuntimeError("no learner yet")
  [fig] = records.run_figure("k", "title", boom, goal=">= 1")
  assert fig["error"] == "RuntimeError: no learner yet" and fig["goal_met"] is None


def test_normalize_figures_keeps_unknown_payload():
  job = run.Job("step", "m", "title", 1, 1)
  [fig] = run.normalize_figures(job, {"vcpo_over_grpo": 1.2})
  assert fig["details"]["raw"] == {"vcpo_over_grpo": 1.2} and fig["key"] == "step"
  figs = [records.figure("a", "A", value=1.0)]
  assert run.normalize_figures(job, {"figures": figs}) == figs


def test_select_jobs_rejects_unknown_names():
  assert [j.name for j in run.select_jobs("decode,flops")] == ["decode", "flops"]
  with pytest.raises(ValueError, match="--only"):
    run.select_jobs("decode,nope")


FAKE_MODULE = textwrap.dedent("""
    import argparse, json, sys, time
    p = argparse.ArgumentParser(); p.add_argument("--json"); p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    mode = {mode!r}
    if mode == "crash":
      sys.exit("figure exploded")
    if mode == "hang":
      time.sleep(30)
    json.dump([{{"key": "fake", "title": "fake figure", "value": 2.0, "unit": "x", "goal": ">= 1.5",
                "goal_met": True, "stats": None, "details": {{"quick": a.quick}}, "note": "", "error": None}}],
              open(a.json, "w"))
""")


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
  for mode in ("ok", "crash", "hang"):
    (tmp_path / f"fake_bench_{mode}.py").write_text(FAKE_MODULE.format(mode=mode))
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  return tmp_path


@pytest.mark.integration
def test_run_job_isolates_failures(fake_modules):
  [ok] = run.run_job(run.Job("ok", "fake_bench_ok", "ok", 30, 30), quick=True)
  assert ok["value"] == 2.0 and ok["details"]["quick"] is True and "job_seconds" in ok["details"]
  [crash] = run.run_job(run.Job("crash", "fake_bench_crash", "crash title", 30, 30), quick=False)
  assert crash["title"] == "crash title" and "exit code 1" in crash["error"]
  assert "figure exploded" in crash["error"]
  [hang] = run.run_job(run.Job("hang", "fake_bench_hang", "hang", 1, 1), quick=False)
  assert hang["error"] == "timed out after 1 s"
  [scaled] = run.run_job(run.Job("hang", "fake_bench_hang", "hang", 1, 1), quick=False, limit_scale=2.0)
  assert scaled["error"] == "timed out after 2 s"
  [missing] = run.run_job(run.Job("m", "fake_bench_missing", "m", 30, 30), quick=False)
  assert "No module named" in missing["error"]


@pytest.mark.integration
def test_main_writes_json_and_markdown_despite_a_failing_figure(fake_modules, tmp_path, monkeypatch):
  monkeypatch.setenv(model_choice.MODEL_ENV, "auto")  # run.main fixes the resolved model in the environment
  monkeypatch.setattr(run, "JOBS", (run.Job("ok", "fake_bench_ok", "ok", 30, 30),
                                    run.Job("crash", "fake_bench_crash", "crash", 30, 30)))
  out = tmp_path / "out"
  run.main(["--quick", "--out-dir", str(out)])
  results = json.loads((out / "results.json").read_text())
  assert [f["key"] for f in results["figures"]] == ["fake", "crash"]
  assert results["figures"][1]["error"] and results["mode"] == "quick"
  import jax
  assert results["environment"].get("backend") == jax.default_backend(), results["environment"]
  assert results["environment"]["model"] == model_choice.resolve_model(backend=jax.default_backend())
  md = (out / "results.md").read_text()
  assert "fake figure" in md and "not measured" in md


def test_goals_table_says_where_each_goal_was_measured():
  fig = lambda key, value, goal, unit="": records.figure(key, key, value=value, unit=unit, goal=goal)
  results = _results([fig("compile_vcpo_seconds", 4.0, "<= 10", "s"), fig("grpo_mfu", 0.2, ">= 0.45", "%"),
                      records.failed_figure("learner_vcpo_over_grpo", "t", "boom")])
  rows = {r[0]: r for r in (markdown.goal_row(g, results["figures"], results["environment"]) for g in goals.GOALS)}
  compile_row = next(r for t, r in rows.items() if t.startswith("compile"))
  assert "(met)" in compile_row[1] and "compile only" in compile_row[2] and "unverified" not in compile_row[2]
  mfu = next(r for t, r in rows.items() if t.startswith("GRPO-step MFU"))
  assert "20.00%" in mfu[1] and "NOT met" in mfu[1] and "unverified on GPU" in mfu[2]
  assert "not measured: boom" in next(r for t, r in rows.items() if t.startswith("VCPO / GRPO"))[1]
  assert next(r for t, r in rows.items() if t.startswith("decode"))[1] == "not in this run"
  md = markdown.render_markdown({**results, "command": ".venv/bin/python -m benchmarks.cpu.run --only compile"})
  assert "## Goals" in md and "`.venv/bin/python -m benchmarks.cpu.run --only compile`" in md


@pytest.mark.integration
def test_run_records_the_command_and_commit():
  assert run.command_line(["--only", "compile"]) == ".venv/bin/python -m benchmarks.cpu.run --only compile"
  assert environment.git_commit() not in ("", None)
