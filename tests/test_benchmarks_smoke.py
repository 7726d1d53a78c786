"""Benchmark harness: statistics, goal checks, table rendering and failure isolation of figure subprocesses."""
import json
import sys
import textwrap

import numpy as np
import pytest

from benchmarks import common
from benchmarks import run


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_summarize_matches_numpy(n):
  samples = np.random.default_rng(n).exponential(1.0, n).tolist()
  st = common.summarize(samples)
  assert st.median == pytest.approx(float(np.median(samples)))
  assert (st.min, st.max, st.n) == (min(samples), max(samples), n)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_summarize_rejects_bad_samples(bad):
  with pytest.raises(ValueError, match="samples"):
    common.summarize(bad)


def test_ratio_samples_pairs_rounds():
  assert common.ratio_samples([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
  with pytest.raises(ValueError, match="num and den"):
    common.ratio_samples([1.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="den"):
    common.ratio_samples([1.0], [0.0])


@pytest.mark.parametrize("value,goal,met", [
    (1.2, "<= 1.3", True), (1.3, "<= 1.3", True), (1.31, "<= 1.3", False), (0.01, "< 0.01", False),
    (4.0, ">= 4", True), (3.99, ">= 4", False), (2.0, "> 1.5", True), (None, ">= 4", None), (1.0, None, None),
    (float("nan"), ">= 1", None)])
def test_goal_met(value, goal, met):
  assert common.goal_met(value, goal) is met


@pytest.mark.parametrize("goal", ["about 3", "=> 3", "<= x"])
def test_goal_met_rejects_malformed_goal(goal):
  with pytest.raises(ValueError, match="goal"):
    common.goal_met(1.0, goal)


def test_time_calls_interleaves_rounds_after_warmup():
  log = []
  fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
  times = common.time_calls(fns, warmup=2, repeats=3, sync=lambda x: x)
  assert log == ["a", "b"] * 5
  assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
  assert all(t >= 0 for v in times.values() for t in v)
  with pytest.raises(ValueError, match="repeats"):
    common.time_calls(fns, repeats=0)


def test_time_once_waits_for_jax_results():
  import jax
  import jax.numpy as jnp
  x = jnp.ones((256, 256))
  seconds = common.time_once(lambda: jax.jit(lambda a: a @ a)(x))
  assert seconds > 0


def _results(figures):
  return {"environment": {"date_utc": "2026-01-01 00:00:00 UTC", "cpu_model": "Test CPU", "cpu_cores": 2,
                          "platform": "linux", "backend": "cpu", "devices": "1 x cpu", "python": "3.x",
                          "versions": {"jax": "0.0"}},
          "mode": "full", "figures": figures}


def test_render_markdown_rows_values_and_errors():
  ok = common.figure("a", "step ratio | vcpo/grpo", unit="x", goal="<= 1.3",
                     stats=common.summarize([1.1, 1.25, 1.4]), details={"B": 64})
  bad = common.failed_figure("b", "async steps/hour", "train loop missing", goal=">= 1.5")
  share = common.figure("c", "arith share", unit="%", goal="< 0.01", stats=common.summarize([0.002, 0.004]))
  md = common.render_markdown(_results([ok, bad, share]))
  rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
  assert len(rows) == 4  # header + one per figure
  assert "step ratio \\| vcpo/grpo" in rows[1] and "1.25x" in rows[1] and "1.10x - 1.40x" in rows[1]
  assert "| yes |" in rows[1]
  assert "not measured" in rows[2] and "train loop missing" in rows[2]
  assert "0.30%" in rows[3] and "| < 1.00% | yes |" in rows[3]
  assert "| <= 1.30x |" in rows[1]
  assert "Test CPU" in md and "backend: cpu" in md and '"B": 64' in md


def test_figure_goal_reflects_median():
  fig = common.figure("x", "t", unit="x", goal=">= 4", stats=common.summarize([3.0, 3.5, 5.0]))
  assert fig["value"] == 3.5 and fig["goal_met"] is False


def test_run_figure_turns_exceptions_into_error_figures():
  def boom():
    raise RuntimeError("no learner yet")
  [fig] = common.run_figure("k", "title", boom, goal=">= 1")
  assert fig["error"] == "RuntimeError: no learner yet" and fig["goal_met"] is None


def test_normalize_figures_keeps_unknown_payload():
  job = run.Job("step", "m", "title", 1, 1)
  [fig] = run.normalize_figures(job, {"vcpo_over_grpo": 1.2})
  assert fig["details"]["raw"] == {"vcpo_over_grpo": 1.2} and fig["key"] == "step"
  figs = [common.figure("a", "A", value=1.0)]
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


def test_run_job_isolates_failures(fake_modules):
  [ok] = run.run_job(run.Job("ok", "fake_bench_ok", "ok", 30, 30), quick=True)
  assert ok["value"] == 2.0 and ok["details"]["quick"] is True and "job_seconds" in ok["details"]
  [crash] = run.run_job(run.Job("crash", "fake_bench_crash", "crash title", 30, 30), quick=False)
  assert crash["title"] == "crash title" and "exit code 1" in crash["error"]
  assert "figure exploded" in crash["error"]
  [hang] = run.run_job(run.Job("hang", "fake_bench_hang", "hang", 1, 1), quick=False)
  assert hang["error"] == "timed out after 1 s"
  [missing] = run.run_job(run.Job("m", "fake_bench_missing", "m", 30, 30), quick=False)
  assert "No module named" in missing["error"]


def test_main_writes_json_and_markdown_despite_a_failing_figure(fake_modules, tmp_path, monkeypatch):
  monkeypatch.setenv(common.MODEL_ENV, "auto")  # run.main fixes the resolved model in the environment
  monkeypatch.setattr(run, "JOBS", (run.Job("ok", "fake_bench_ok", "ok", 30, 30),
                                    run.Job("crash", "fake_bench_crash", "crash", 30, 30)))
  out = tmp_path / "out"
  run.main(["--quick", "--out-dir", str(out)])
  results = json.loads((out / "results.json").read_text())
  assert [f["key"] for f in results["figures"]] == ["fake", "crash"]
  assert results["figures"][1]["error"] and results["mode"] == "quick"
  import jax
  assert results["environment"].get("backend") == jax.default_backend(), results["environment"]
  assert results["environment"]["model"] == common.resolve_model(backend=jax.default_backend())
  md = (out / "results.md").read_text()
  assert "fake figure" in md and "not measured" in md


def test_async_read_steps_ignores_torn_last_line(tmp_path):
  from benchmarks import bench_async
  path = tmp_path / "metrics.jsonl"
  assert bench_async.read_steps(str(path)) == []
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2}\n{"step": 3, "lo')
  assert bench_async.read_steps(str(path)) == [1, 2]


def test_async_rate_arithmetic():
  from benchmarks import bench_async
  times = {1: 0.0, 2: 100.0, 3: 110.0, 5: 130.0}  # step 4 not seen
  assert bench_async.step_intervals(times, skip=1) == [10.0, 10.0]
  assert bench_async.steps_per_hour(times, skip=1) == pytest.approx(3600.0 * 3 / 30.0)
  with pytest.raises(ValueError, match="skip"):
    bench_async.steps_per_hour(times, skip=3)
  cmd = bench_async.train_command("/w", 2, ["sft.steps=0"], steps=7)
  assert "--config.rl.max_lag=2" in cmd and "--config.rl.steps=7" in cmd and "--config.sft.steps=0" in cmd


def test_async_watch_training_stamps_steps_and_stops_the_run(tmp_path):
  from benchmarks import bench_async
  workdir = tmp_path / "w"
  metrics = workdir / "metrics.jsonl"
  writer = (f"import json, time\nfor s in range(1, 100):\n  time.sleep(0.3)\n"
            f"  open({str(metrics)!r}, 'a').write(json.dumps({{'step': s}}) + '\\n')\n")
  times, ended = bench_async.watch_training([sys.executable, "-c", writer], str(workdir), want_steps=3,
                                            time_limit_s=60)
  assert ended == "enough steps" and sorted(times)[:3] == [1, 2, 3]
  assert times[1] < times[2] < times[3]
  times, ended = bench_async.watch_training([sys.executable, "-c", "import sys; sys.exit('bad config')"],
                                            str(tmp_path / "w2"), want_steps=3, time_limit_s=60)
  assert times == {} and ended.startswith("exited with code 1") and "bad config" in ended


def test_run_subprocess_timeout_ends_grandchildren_in_other_sessions(tmp_path):
  import subprocess
  import time
  pid_file = tmp_path / "grandchild.pid"
  # The child starts a grandchild in a session of its own (as the training job starts its servers).
  script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)'], start_new_session=True); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            f"time.sleep(60)")
  with pytest.raises(subprocess.TimeoutExpired):
    common.run_subprocess([sys.executable, "-c", script], timeout=2.0)
  grandchild = int(pid_file.read_text())
  for _ in range(50):
    if not common._alive(grandchild):
      break
    time.sleep(0.1)
  assert not common._alive(grandchild)


def test_decode_baseline_takes_the_faster_variant_per_round():
  from benchmarks import bench_decode
  assert bench_decode.best_of_rounds([1.0, 5.0, 2.0], [3.0, 1.0, 2.5]) == [1.0, 1.0, 2.0]
  assert bench_decode.random_prompts(3, 5, 10) == bench_decode.random_prompts(3, 5, 10)
  assert all(len(p) == 5 and all(1 <= t < 10 for t in p) for p in bench_decode.random_prompts(3, 5, 10))


def test_async_speedup_figures_pair_steps_and_report_failed_runs():
  from benchmarks import bench_async
  setup = bench_async.AsyncSetup(lags=(0, 2, 4), measured_steps=3, skip=1, budget_s=10, overrides=())
  details = {"k0": {"intervals_s": [4.0, 6.0, 5.0]}, "k2": {"intervals_s": [2.0, 3.0, 5.0, 1.0]}}
  figs = bench_async.speedup_figures(setup, {0: 720.0, 2: 1200.0}, {4: "RuntimeError: boom"}, details)
  assert [f["key"] for f in figs] == ["async_speedup_k2", "async_speedup_k4"]
  assert figs[0]["stats"] == {"median": 2.0, "min": 1.0, "max": 2.0, "n": 3} and figs[0]["goal_met"] is True
  assert "1.67x" in figs[0]["note"]
  assert figs[1]["error"] == "k=4: RuntimeError: boom" and figs[1]["value"] is None


def test_async_steps_seen_in_one_poll_count_once():
  """Fast steps (an accelerator) can appear in the same poll: no zero-length interval ("den must be
  positive" before), the group is timed at its last step."""
  from benchmarks import bench_async
  times = {1: 0.0, 2: 5.0, 3: 5.0, 4: 9.0, 5: 9.0, 6: 9.0}
  assert bench_async.step_intervals(times, skip=0) == pytest.approx([5.0 / 2, 4.0 / 3])
  assert all(i > 0 for i in bench_async.step_intervals(times, skip=1))
  setup = bench_async.AsyncSetup(lags=(0, 2), measured_steps=2, skip=0, budget_s=1, overrides=())
  details = {"k0": {"intervals_s": bench_async.step_intervals(times, 0)},
             "k2": {"intervals_s": bench_async.step_intervals(times, 0)}}
  [fig] = bench_async.speedup_figures(setup, {0: 1.0, 2: 1.0}, {}, details)
  assert fig["value"] == 1.0


def test_model_option_resolves_by_backend_and_picks_the_job(monkeypatch):
  assert common.resolve_model("auto", backend="cpu") == "main"
  assert common.resolve_model("auto", backend="gpu") == "qwen2.5-0.5b"
  assert common.resolve_model("main", backend="gpu") == "main"
  with pytest.raises(ValueError, match="--model"):
    common.resolve_model("7b", backend="cpu")
  monkeypatch.setenv(common.MODEL_ENV, "qwen2.5-0.5b")
  cfg = common.model_config()
  assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.dtype) == (896, 24, 151936, "bfloat16")
  from benchmarks import bench_async, bench_decode
  assert bench_async.setup_for(quick=True).config == "configs/qwen2_5.py:0.5b"
  assert bench_decode.main_job_model_config().param_dtype == "bfloat16"
  monkeypatch.setenv(common.MODEL_ENV, "main")
  assert common.model_config().hidden_size == 128 and bench_async.setup_for(quick=False) is bench_async.FULL
  cmd = bench_async.train_command("/w", 0, [], config="configs/qwen2_5.py:0.5b")
  assert "--config=configs/qwen2_5.py:0.5b" in cmd
