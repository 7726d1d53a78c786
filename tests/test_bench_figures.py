"""The CPU benchmarks' own logic: async rates, the decode baseline, the model option, compile variants and fit."""
import sys

import pytest

from benchmarks.common import model_choice
from benchmarks.cpu import run
from vcpo_jax.rollout.servers import launcher


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
