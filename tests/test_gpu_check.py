"""The GPU check (benchmarks/gpu/gpu_check.py): its report's readers on hand-written files, a part stopped at its
time limit, and the dry mode end to end on the CPU (every part, small shapes)."""
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest

from benchmarks.gpu import gpu_check
from benchmarks.gpu import gpu_check_report as report

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="5">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_b" name="test_err"><error message="fixture boom">trace</error></testcase>
<testcase classname="tests.test_b" name="test_s1"><skipped message="cpu_only on gpu: exact float64"/></testcase>
<testcase classname="tests.test_b" name="test_s2"><skipped message="cpu_only on gpu: exact float64"/></testcase>
</testsuite></testsuites>"""


def test_unit_summary_reads_junit(tmp_path):
  (tmp_path / "unit.xml").write_text(JUNIT)
  s = report.unit_summary(str(tmp_path))
  assert (s["tests"], s["passed"], s["failed"], s["errors"], s["skipped"]) == (5, 1, 1, 1, 2)
  assert [f["test"] for f in s["failures"]] == ["tests.test_a::test_bad", "tests.test_b::test_err"]
  assert s["failures"][0]["message"] == "assert 1 == 2"
  assert s["skip_reasons"] == {"cpu_only on gpu: exact float64": 2}


def test_unit_summary_falls_back_to_the_log(tmp_path):
  (tmp_path / "unit.log").write_text("....F\n!!! KeyboardInterrupt !!!\n"
                                     "1 failed, 12 passed, 3 skipped, 2 errors in 80.1s\n")
  assert report.unit_summary(str(tmp_path)) == {"junit": False, "failed": 1, "passed": 12, "skipped": 3,
                                                 "errors": 2}


def test_job_summary_accuracy_and_steady_rate(tmp_path):
  (tmp_path / "result.json").write_text(json.dumps({
      "base": {"eval/greedy_accuracy": 0.25, "eval/sampled_accuracy": 0.2},
      "final": {"eval/greedy_accuracy": 0.5, "eval/sampled_accuracy": 0.4}, "steps": 6}))
  seconds = [9.0, 3.0, 1.0, 2.0, 1.0, 4.0]
  lines = [json.dumps({"step": i + 1, "throughput/step_seconds": s}) for i, s in enumerate(seconds)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 7, "thr')  # a torn last line
  s = report.job_summary(str(tmp_path))
  assert s["finished"] and s["steps_logged"] == 6
  assert (s["base_greedy_accuracy"], s["final_greedy_accuracy"], s["final_sampled_accuracy"]) == (0.25, 0.5, 0.4)
  assert s["steady_steps"] == 4 and s["steps_per_s"] == pytest.approx(4 / 8.0)
  assert s["all_steps_per_s"] == pytest.approx(6 / 20.0) and s["median_step_s"] == pytest.approx(1.5)
  assert report.job_summary(str(tmp_path / "missing")) == {"finished": False, "steps_logged": 0}


@pytest.mark.parametrize("scan_layers,tied", [(True, True), (False, True), (False, False)])
def test_mfu_counts_every_kernel_with_or_without_scan(scan_layers, tied):
  """The MFU's matmul parameters against the architecture's own count (stacked layer kernels included)."""
  import dataclasses
  import jax
  from benchmarks.cpu import bench_flops
  from benchmarks.common import model_choice
  from vcpo_jax.model import transformer as model_lib
  cfg = dataclasses.replace(model_choice.model_config("tiny"), num_layers=3, scan_layers=scan_layers,
                            tie_word_embeddings=tied)
  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
  expected = cfg.num_layers * per_layer + cfg.vocab_size * h  # the LM head, tied or not
  assert bench_flops.matmul_params(cfg, params) == expected
  tokens = 4 * 16
  attention = 12 * cfg.num_layers * 16 ** 2 * cfg.num_heads * cfg.head_dim * 4
  assert bench_flops.analytic_step_flops(cfg, params, 4, 16) == 6 * expected * tokens + attention


def test_parts_have_a_command_and_fit_the_budget():
  ctx = gpu_check.Context(dry=False, work="/w", python="py", rl_steps=20)
  limits = {p.name: p.limit_s for p in gpu_check.PARTS}
  assert sum(limits[n] for n in gpu_check.DEFAULT_PARTS) + 10 <= gpu_check.BUDGET_S
  assert sum(limits[n] for n in gpu_check.SECOND_CALL_PARTS) + 10 <= gpu_check.SECOND_CALL_BUDGET_S
  assert sum(limits[n] for n in gpu_check.SWEEP_CALL_PARTS) + 10 <= gpu_check.SWEEP_CALL_BUDGET_S
  assert limits["sweep"] <= 8 * 60  # the sweep's budget on one GPU
  assert set(limits) == (set(gpu_check.DEFAULT_PARTS) | set(gpu_check.SECOND_CALL_PARTS)
                         | set(gpu_check.SWEEP_CALL_PARTS))
  sweep, extra = gpu_check.part_command("sweep", ctx)
  assert sweep[1:3] == ["-m", "benchmarks.gpu.bench_gpu_sweep"] and extra == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  wire, extra = gpu_check.part_command("wire", ctx)
  assert wire[1:3] == ["-m", "benchmarks.gpu.bench_gpu_wire"] and extra == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  job, extra = gpu_check.part_command("job", ctx)
  assert "--config=configs/countdown.py" in job and "--config.rl.steps=20" in job and "--config.rl.max_lag=2" in job
  unit, extra = gpu_check.part_command("unit", ctx)
  assert extra == {"VCPO_TEST_TIER": "unit"} and "not slow and not integration" in unit and "tests" in unit
  env = gpu_check.base_env(ctx, "/site")
  assert env["JAX_PLATFORMS"] == "cuda" and env["PYTHONPATH"].split(":")[:2] == [gpu_check.REPO_ROOT, "/site"]
  with pytest.raises(ValueError, match="unknown part"):
    gpu_check.part_command("nope", ctx)


def test_the_steps_part_leaves_every_variant_its_minimum():
  """A steps limit under bench_gpu_step's reserves gave its first variants 10 s each (they compile for ~10 s)."""
  from benchmarks.gpu import bench_gpu_step
  for part in gpu_check.PARTS:
    if part.name == "steps":
      assert gpu_check.bench_limit_s(part.limit_s) >= bench_gpu_step.min_limit_s() + bench_gpu_step.MIN_CHILD_S
      assert gpu_check.bench_limit_s(part.dry_limit_s) >= bench_gpu_step.min_limit_s()
  with pytest.raises(ValueError, match="BENCH_JOB_LIMIT_S=65 leaves the 3 variants"):
    bench_gpu_step.run_children(quick=True, limit_s=65)


def test_sweep_levers_have_reasons_and_their_gemms_are_the_model_flops():
  """At most 12 combinations (with the combined best), each with its reason and valid overrides; the ceiling's
  GEMMs are exactly the 6 N tokens of the MFU count (forward, dX, dW of every kernel)."""
  import dataclasses
  import jax
  from benchmarks.cpu import bench_flops
  from benchmarks.gpu import gpu_sweep_levers as levers
  from benchmarks.common import model_choice
  from vcpo_jax.model import config as model_config
  from vcpo_jax.model import transformer as model_lib
  names = [lever.name for lever in levers.LEVERS]
  assert len(set(names)) == len(names) and len(names) + 1 <= 12 and names[0] == "baseline"
  fields = {f.name for f in dataclasses.fields(model_config.ModelConfig)}
  for lever in levers.LEVERS:
    assert len(lever.reason) > 30 and lever.limit_s <= 90
    for key, _ in lever.overrides:
      assert key.startswith(("xla_gpu_", "algo.")) or key.removeprefix("model.") in fields, key
  cfg = model_choice.model_config("qwen2.5-0.5b")
  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  gemm_flops = sum(2 * m * k * n * count for _, m, k, n, count in levers.gemm_shapes(cfg, 4096))
  assert gemm_flops == 6 * bench_flops.matmul_params(cfg, params) * 4096


def test_sweep_combines_the_levers_that_helped():
  from benchmarks.gpu import gpu_sweep_levers as levers
  seconds = {"baseline": 1.0, "causal": 0.9, "tiles": 0.8, "micro16": 0.7, "micro64": 0.75, "xla_flags": 0.78,
             "unrolled": 0.85, "plain": 0.79, "f32_head": 0.5}
  best = levers.combined(seconds)
  fields = dict(best.overrides)
  assert fields["algo.micro_batch_size"] == "16"            # the best; micro64 sets the same field: left out
  assert fields["xla_gpu_enable_triton_gemm"] == "false"    # beat tiles, sets other fields: added
  assert fields["model.lm_head"] == "token_tiles"           # plain conflicts with the best's head: left out
  assert "model.scan_layers" not in fields and "model.head_dtype" not in fields  # slower / a precision lever
  assert "micro16 + xla_flags" in best.reason
  assert levers.combined({"baseline": 1.0, "causal": 1.2}) is None


def test_sweep_figures_and_section_from_child_results():
  """The report's figures and markdown from hand-written child results: MFU against the peak and the ceiling at
  the lever's own micro-batch, the best lever's VCPO ratios, the top ops, failed levers as rows."""
  from benchmarks.gpu import gpu_sweep_levers as levers
  from benchmarks.gpu import gpu_sweep_report as report

  def result(seconds, tokens=4096):
    return {"seconds": seconds, "micro_tokens": tokens, "analytic_flops": 1e14, "overrides": [], "remat": "none",
            "xla_memory": {"peak_estimate_bytes": 24e9}, "compile_s": 12.0, "backend": "gpu", "rows": 64,
            "seq_len": 512, "device_memory_after": {"peak_bytes_in_use": 25e9},
            "top_ops": [{"op": "fusion.1", "ms_per_step": 100.0, "share": 0.2, "what": "fusion kLoop -> f32[8]"}]}
  ceiling = {"peak": 7e14, "peak_details": {}, "ceilings": {"4096": {"flop_per_s": 4e14, "gemms": []},
                                                            "8192": {"flop_per_s": 5e14, "gemms": []}}}
  results = {"baseline": result([0.75, 0.74]), "micro16": result([0.4, 0.4], tokens=8192),
             "f32_head": result([0.3, 0.3]), "vcpo_bounded@micro16": result([0.44, 0.44], tokens=8192)}
  errors = {"tiles": "timed out after 60 s", "vcpo_book_keeping@micro16": "exit code 1: boom"}
  figs = report.figures(ceiling, results, errors, None)
  by_key = {f["key"]: f for f in figs}
  assert report.best_lever(results) == "micro16"  # f32_head is faster but a precision lever
  d = by_key["sweep_step_micro16"]["details"]
  assert d["mfu_peak"] == pytest.approx(1e14 / 0.4 / 7e14) and d["mfu_ceiling"] == pytest.approx(1e14 / 0.4 / 5e14)
  assert by_key["sweep_step_baseline"]["details"]["ceiling_tokens"] == 4096
  assert by_key["sweep_best_mfu"]["value"] == pytest.approx(1e14 / 0.4 / 7e14)
  assert by_key["sweep_vcpo_bounded_over_grpo"]["value"] == pytest.approx(1.1)
  assert by_key["sweep_vcpo_book_keeping_over_grpo"]["error"] and by_key["sweep_step_tiles"]["error"]
  md = report.section(figs)
  assert "| tiles | timed out after 60 s |" in md and "lever micro16:" in md and "lever baseline:" in md
  assert md.count("| fusion.1 | 100.00 | 20.0% |") == 2 and levers.LEVERS[0].reason in md


@pytest.mark.integration
def test_a_part_past_its_limit_is_stopped_with_its_children(tmp_path):
  """A part that outlives its limit gets SIGINT, then is killed with its child (which ignores SIGINT)."""
  pid_file = tmp_path / "child.pid"
  code = ("import signal, subprocess, sys, time\n"
          f"c = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGINT, "
          f"signal.SIG_IGN); time.sleep(60)'], start_new_session=True)\n"
          f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)\n")
  start = time.monotonic()
  result = gpu_check.run_part("slow", [sys.executable, "-c", code], dict(os.environ), gpu_check.STOP_GRACE_S + 3,
                              str(tmp_path / "slow.log"))
  assert result["status"] == "timed out" and time.monotonic() - start < 30
  child = int(pid_file.read_text())
  from vcpo_jax.rollout.servers import launcher
  deadline = time.monotonic() + 5
  while launcher.is_alive(child) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not launcher.is_alive(child)
  assert "started" in (tmp_path / "slow.log").read_text()
  ok = gpu_check.run_part("ok", [sys.executable, "-c", "print('hi')"], dict(os.environ), 30, str(tmp_path / "ok.log"))
  assert (ok["status"], ok["returncode"]) == ("ok", 0)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.extra  # minutes of CPU: `make test-extra`, which CI runs after `make test`
@pytest.mark.timeout(2400)
def test_dry_mode_runs_every_part_and_writes_the_report(tmp_path):
  out = tmp_path / "out"
  env = {k: v for k, v in os.environ.items() if k != "OUT"}
  # Wide limits: this checks the code path, and a loaded 2-core machine can take minutes per part.
  limits = [f"--limit={name}={seconds}" for name, seconds in
            (("env", 120), ("steps", 300), ("decode", 300), ("wire", 300), ("job", 300), ("unit", 200),
             ("sweep", 600))]
  proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_check", "--dry", "--out", str(out),
                         "--budget-s", "2200"] + limits, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=2300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(os.listdir(out)) == ["details.tar.gz", "gpu_check.json", "gpu_check.log", "results-gpu.md"]
  results = json.loads((out / "gpu_check.json").read_text())
  parts = {p["part"]: p for p in results["parts"]}
  assert list(parts) == ["env", "steps", "decode", "wire", "job", "unit", "sweep"]
  assert {n: p["status"] for n, p in parts.items()} == dict.fromkeys(parts, "ok"), (out / "gpu_check.log").read_text()
  figures = {f["key"]: f for f in results["figures"]}
  for key in ("gpu_matmul_peak", "grpo_mfu", "vcpo_book_keeping_over_grpo", "vcpo_bounded_over_grpo",
              "peak_memory_grpo", "peak_memory_vcpo_bounded", "hbm_bandwidth", "decode_floor_fraction_b4",
              "decode_engine_vs_hf_b2", "decode_engine_vs_hf_b4", "wire_publish_gloo", "disk_publish"):
    assert key in figures and not figures[key]["error"], (key, figures.get(key))
  assert figures["peak_memory_grpo"]["details"]["xla_memory"]["peak_estimate_bytes"] > 0
  from benchmarks.gpu import gpu_sweep_levers  # the sweep: every lever, the ceiling, profiles, VCPO at the best
  for key in ["sweep_matmul_peak", "sweep_best_mfu", "sweep_best_ceiling_fraction", "sweep_vcpo_bounded_over_grpo",
              "sweep_vcpo_book_keeping_over_grpo"] + [f"sweep_step_{lever.name}" for lever in gpu_sweep_levers.LEVERS]:
    assert key in figures and not figures[key]["error"], (key, figures.get(key))
  assert figures["sweep_step_baseline"]["details"]["top_ops"]
  assert any(k.startswith("sweep_gemm_ceiling_") and figures[k]["value"] > 0 for k in figures)
  job = results["job"]
  assert job["finished"] and job["steps_logged"] == 2 and 0 <= job["final_greedy_accuracy"] <= 1
  assert job["steps_per_s"] > 0
  unit = results["unit"]
  assert unit["junit"] and unit["passed"] > 0 and unit["failed"] == unit["errors"] == 0
  assert results["environment"]["backend"] == "cpu" and results["mode"].startswith("dry")
  md = (out / "results-gpu.md").read_text()
  headings = [line for line in md.splitlines() if line.startswith("#")]
  assert headings == ["# vcpo_jax GPU check", "## Parts", "## Goals", "## Main job, shortened (warm start + RL, "
                      "async k=2, learner and one embedded server on one device)", "## Unit tier",
                      "## Sweep (levers of the GRPO step)", "## Details"]
  assert "python3 -m benchmarks.gpu.gpu_check --dry" in md and "backend: cpu" in md
  goal_rows = [line for line in md.split("## Goals")[1].split("##")[0].splitlines() if line.startswith("| ")]
  assert figures["wire_served_equal_gloo"]["value"] == 1.0  # the wire-updated server serves the learner's weights
  assert len(goal_rows) == 2 + 5 and all("unverified on GPU" in row for row in goal_rows[2:5] + goal_rows[6:])
  assert "not in this run" in goal_rows[5]  # the B=256 decode goal: the dry mode decodes at B=2 and 4
  with tarfile.open(out / "details.tar.gz") as tar:
    names = set(tar.getnames())
  assert {"unit.xml", "steps.json", "decode.json", "wire.json", "job/result.json", "job/metrics.jsonl", "env.log",
          "job.log"} <= names
  assert not os.path.exists(os.path.join(REPO_ROOT, "benchmarks", "gpu", "results-gpu.md")) or "dry" not in open(
      os.path.join(REPO_ROOT, "benchmarks", "gpu", "results-gpu.md")).read()
