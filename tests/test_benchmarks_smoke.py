"""Benchmark harness: statistics, goal checks, table rendering and failure isolation of figure subprocesses."""
import json
import sys
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
from vcpo_jax.rollout.servers import launcher


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


def test_async_read_steps_ignores_torn_last_line(tmp_path):
  from benchmarks.cpu import bench_async
  path = tmp_path / "metrics.jsonl"
  assert bench_async.read_steps(str(path)) == []
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2}\n{"step": 3, "lo')
  assert bench_async.read_steps(str(path)) == [1, 2]


def test_async_rate_arithmetic():
  from benchmarks.cpu import bench_async
  times = {1: 0.0, 2: 100.0, 3: 110.0, 5: 130.0}  # step 4 not seen
  assert bench_async.step_intervals(times, skip=1) == [10.0, 10.0]
  assert bench_async.steps_per_hour(times, skip=1) == pytest.approx(3600.0 * 3 / 30.0)
  with pytest.raises(ValueError, match="skip"):
    bench_async.steps_per_hour(times, skip=3)
  cmd = bench_async.train_command("/w", 2, ["sft.steps=0"], steps=7)
  assert "--config.rl.max_lag=2" in cmd and "--config.rl.steps=7" in cmd and "--config.sft.steps=0" in cmd


@pytest.mark.integration
def test_async_watch_training_stamps_steps_and_stops_the_run(tmp_path):
  from benchmarks.cpu import bench_async
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


@pytest.mark.integration
def test_run_subprocess_timeout_ends_grandchildren_in_other_sessions(tmp_path):
  import subprocess
  import time
  pid_file = tmp_path / "grandchild.pid"
  # The child starts a grandchild in a session of its own (as the training job starts its servers).
  script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)'], start_new_session=True); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            f"time.sleep(60)")
  with pytest.raises(subprocess.TimeoutExpired):
    run.run_subprocess([sys.executable, "-c", script], timeout=2.0)
  grandchild = int(pid_file.read_text())
  for _ in range(50):
    if not launcher.is_alive(grandchild):
      break
    time.sleep(0.1)
  assert not launcher.is_alive(grandchild)


def test_decode_baseline_takes_the_faster_variant_per_round():
  from benchmarks.cpu import bench_decode, decode_engine
  assert bench_decode.best_of_rounds([1.0, 5.0, 2.0], [3.0, 1.0, 2.5]) == [1.0, 1.0, 2.0]
  assert decode_engine.random_prompts(3, 5, 10) == decode_engine.random_prompts(3, 5, 10)
  assert all(len(p) == 5 and all(1 <= t < 10 for t in p) for p in decode_engine.random_prompts(3, 5, 10))


def test_async_speedup_figures_pair_steps_and_report_failed_runs():
  from benchmarks.cpu import bench_async
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
  from benchmarks.cpu import bench_async
  times = {1: 0.0, 2: 5.0, 3: 5.0, 4: 9.0, 5: 9.0, 6: 9.0}
  assert bench_async.step_intervals(times, skip=0) == pytest.approx([5.0 / 2, 4.0 / 3])
  assert all(i > 0 for i in bench_async.step_intervals(times, skip=1))
  setup = bench_async.AsyncSetup(lags=(0, 2), measured_steps=2, skip=0, budget_s=1, overrides=())
  details = {"k0": {"intervals_s": bench_async.step_intervals(times, 0)},
             "k2": {"intervals_s": bench_async.step_intervals(times, 0)}}
  [fig] = bench_async.speedup_figures(setup, {0: 1.0, 2: 1.0}, {}, details)
  assert fig["value"] == 1.0


def test_model_option_resolves_by_backend_and_picks_the_job(monkeypatch):
  assert model_choice.resolve_model("auto", backend="cpu") == "main"
  assert model_choice.resolve_model("auto", backend="gpu") == "qwen2.5-0.5b"
  assert model_choice.resolve_model("main", backend="gpu") == "main"
  with pytest.raises(ValueError, match="--model"):
    model_choice.resolve_model("7b", backend="cpu")
  monkeypatch.setenv(model_choice.MODEL_ENV, "qwen2.5-0.5b")
  cfg = model_choice.model_config()
  assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.dtype) == (896, 24, 151936, "bfloat16")
  from benchmarks.cpu import bench_async, bench_decode
  assert bench_async.setup_for(quick=True).config == "configs/qwen2_5.py:0.5b"
  assert bench_decode.main_job_model_config().param_dtype == "bfloat16"
  monkeypatch.setenv(model_choice.MODEL_ENV, "main")
  assert model_choice.model_config().hidden_size == 128 and bench_async.setup_for(quick=False) is bench_async.FULL
  cmd = bench_async.train_command("/w", 0, [], config="configs/qwen2_5.py:0.5b")
  assert "--config=configs/qwen2_5.py:0.5b" in cmd


def test_model_option_aliases_and_tiny(monkeypatch):
  assert model_choice.resolve_model("countdown", backend="gpu") == "main"
  assert model_choice.resolve_model("tiny", backend="gpu") == "tiny"
  assert model_choice.small_model("tiny") and model_choice.small_model("countdown") and not model_choice.small_model("qwen2.5-0.5b")
  monkeypatch.setenv(model_choice.MODEL_ENV, "tiny")
  assert model_choice.model_config().hidden_size == 32
  from benchmarks.cpu import bench_async
  assert bench_async.setup_for(quick=False).config == "configs/tiny.py"


def test_grpo_baseline_keeps_the_jobs_micro_batching():
  from benchmarks.cpu import bench_flops
  from vcpo_jax.learner import config as learner_config
  lc = learner_config.LearnerConfig(micro_batch_size=8, aggregation="token-mean")
  grpo = bench_flops.grpo_config(lc)
  assert (grpo.advantage, grpo.policy_loss) == ("grpo", "ppo")
  assert (grpo.micro_batch_size, grpo.aggregation) == (8, "token-mean")


def test_compile_variants_follow_the_knobs_present():
  import dataclasses
  from benchmarks.cpu import bench_compile

  @dataclasses.dataclass(frozen=True)
  class Plain:  # a model config from before the knobs
    num_layers: int = 2
  assert [v[0] for v in bench_compile.variants(Plain())] == ["vcpo (defaults)", "grpo (defaults)"]

  @dataclasses.dataclass(frozen=True)
  class WithKnobs:
    scan_layers: bool = False
    remat: str = "none"
    num_layers: int = 2
  found = bench_compile.variants(WithKnobs())
  # The headline pair runs under scan; other knobs are compared under scan too (cheap to compile).
  assert [v[0] for v in found[:2]] == ["vcpo scan_layers=True", "grpo scan_layers=True"]
  labels = {label: (step, over) for label, step, over in found}
  assert labels["grpo scan_layers=False"] == ("grpo", {"scan_layers": False})
  assert labels["vcpo scan_layers=True remat=full"] == ("vcpo", {"scan_layers": True, "remat": "full"})
  assert not any(over.get("remat") == "none" for _, over in labels.values())  # the default is not repeated
  assert not any(o.get("scan_layers") is False for _, _, o in bench_compile.variants(WithKnobs(), unrolled=False))
  scanned = [v[0] for v in bench_compile.variants(WithKnobs(scan_layers=True))]
  assert scanned[:2] == ["vcpo (defaults)", "grpo (defaults)"] and "vcpo remat=dots" in scanned


def _compile_result(total_s, temp_bytes, error=None):
  row = {"variant": "vcpo (defaults)", "step": "vcpo", "layers": 24, "B": 8, "T": 1024, "overrides": {},
         "lower_s": 1.0, "compile_s": total_s - 1.0, "total_s": total_s, "cpu_s": total_s / 2, "tokens": 8192,
         "memory": {"temp_size_in_bytes": temp_bytes}, "temp_mb_per_token": temp_bytes / 8192 / 1e6}
  if error:
    row = {**{k: row[k] for k in ("variant", "step", "layers", "B", "T", "overrides")}, "error": error}
  return {"date_utc": "2026-01-01 00:00:00 UTC", "commit": "abc1234", "backend": "cpu", "cpu_model": "Test CPU",
          "cpu_cores": 2, "versions": {"jax": "0"}, "model": "qwen2.5-0.5b", "quick": False,
          "model_config": {"num_layers": 24}, "knobs_present": [], "rows": [row]}


def test_compile_figures_goals_and_table():
  from benchmarks.cpu import compile_report
  figs = {f["key"]: f for f in compile_report.figures(_compile_result(197.0, 77e9))}
  assert figs["compile_vcpo_seconds"]["value"] == 98.5 and figs["compile_vcpo_seconds"]["goal_met"] is False
  assert figs["compile_vcpo_temp_mb_per_token"]["value"] == pytest.approx(77e9 / 8192 / 1e6)
  assert figs["compile_grpo_seconds"]["error"] == "not measured"
  fast = {f["key"]: f for f in compile_report.figures(_compile_result(16.0, 0.5e9))}  # 8 CPU seconds
  assert fast["compile_vcpo_seconds"]["goal_met"] and fast["compile_vcpo_temp_mb_per_token"]["goal_met"]
  failed = {f["key"]: f for f in compile_report.figures(_compile_result(0, 0, error="XlaRuntimeError: boom"))}
  assert failed["compile_vcpo_seconds"]["error"] == "XlaRuntimeError: boom"
  md = compile_report.render_markdown(_compile_result(197.0, 77e9))
  assert "abc1234" in md and "| vcpo (defaults) | 24 | 8 x 1024 | 1.0 | 196.0 | 197.0 | 98.5 | 77.00 | 9.399 | - |" in md


def test_compile_set_parses_json_values():
  from benchmarks.cpu import bench_compile
  assert bench_compile.parse_sets(["remat=full", "scan_layers=true", "logits_chunk=0"]) == {
      "remat": "full", "scan_layers": True, "logits_chunk": 0}
  with pytest.raises(ValueError, match="--set"):
    bench_compile.parse_sets(["remat"])


def test_temp_fit_separates_fixed_and_per_token_parts():
  from benchmarks.cpu import bench_compile, compile_report
  fixed, per_token = 6e9, 0.25e6
  f = bench_compile.temp_fit(8, 1024, fixed + per_token * 8192, 4, fixed + per_token * 4096)
  assert f["per_token_mb"] == pytest.approx(0.25) and f["fixed_gb"] == pytest.approx(6.0)
  assert f["predicted_gb"] == pytest.approx(6.0 + 0.25e6 * 65536 / 1e9)
  with pytest.raises(ValueError, match="b2"):
    bench_compile.temp_fit(8, 1024, 1, 8, 1)
  result = _compile_result(16.0, fixed + per_token * 8192)
  result["rows"][0]["temp_fit"] = f
  figs = {fig["key"]: fig for fig in compile_report.figures(result)}
  assert figs["compile_vcpo_temp_mb_per_extra_token"]["value"] == pytest.approx(0.25)
  assert figs["compile_vcpo_temp_mb_per_extra_token"]["goal_met"] is False
  assert "6.00 GB + 0.250 MB x tokens" in compile_report.render_markdown(result)


@pytest.mark.slow
def test_compile_one_on_abstract_inputs_allocates_nothing():
  """The tiny model's GRPO step compiled from ShapeDtypeStructs; XLA reports its temporaries."""
  from vcpo_jax.learner import batch as batch_lib
  from vcpo_jax.learner import config as learner_config
  import dataclasses
  import jax
  from benchmarks.cpu import bench_compile
  from vcpo_jax.job import configuration
  cfg = dataclasses.replace(model_choice.model_config("tiny"), num_layers=1, max_seq_len=16)
  optimizer = configuration.build_optimizer(model_choice.job_config("tiny"))
  state = bench_compile.abstract_state(cfg, optimizer)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
  batch_lib.check_batch(bench_compile.abstract_batch(4, 16, group=2))
  row = bench_compile.compile_one(cfg, learner_config.LearnerConfig(advantage="grpo", policy_loss="ppo"), optimizer, 4, 16)
  assert row["tokens"] == 64 and row["lower_s"] > 0 and row["compile_s"] > 0 and row["cpu_s"] > 0
  assert row["memory"]["temp_size_in_bytes"] > 0 and row["temp_mb_per_token"] > 0


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
