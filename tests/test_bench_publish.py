"""benchmarks/cpu/bench_publish.py without a server: parameter bytes, figures and estimates from a measurement."""
import pytest

from benchmarks.cpu import bench_publish
from vcpo_jax.model import hf

# The released Qwen2.5 checkpoints' parameter counts (tied embeddings at 0.5B and 1.5B).
RELEASED = {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "7b": 7_615_616_512}


def _count(size):
  return bench_publish.param_count_and_bytes(hf.model_config(bench_publish.job_config(size).model))


@pytest.mark.parametrize("size", sorted(RELEASED))
def test_param_count_is_the_released_models(size):
  count, nbytes = _count(size)
  assert count == RELEASED[size] and nbytes == 4 * count  # float32 params, as every shipped config has


def _measurement():
  def rounds(first, dtype):
    return [{"version": v, "dtype": dtype, "waited_s": 0.0, "dispatch_s": 0.5, "blocked_s": 0.5,
             "export_s": 2.0 * (v - first + 1), "update_s": 3.0, "pause_s": 3.5, "publish_s": 6.0 + v}
            for v in range(first, first + 3)]

  probe = {"ids": [1, 2, 3], "logprobs_before": [-1.0, -2.0], "logprobs_after": [-1.5, -2.0],
           "version_before": "v0", "version_after": "v3"}
  count = RELEASED["0.5b"]
  return {"shape": "0.5b", "param_count": count, "server_device": "cpu", "server_dtype": "bfloat16",
          "step_seconds": 10.0, "server_ready_s": 40.0,
          "arms": {"disk float32": {"rounds": rounds(1, "float32"), "published_bytes": 4 * count, "probe": probe},
                   "disk bf16": {"rounds": rounds(4, "bfloat16"), "published_bytes": 2 * count, "probe": probe}}}


def test_figures_are_medians_per_arm_in_seconds_and_per_gb():
  figs = {f["key"]: f for f in bench_publish.figures(_measurement())}
  gb32, gb16 = 4 * RELEASED["0.5b"] / 1e9, 2 * RELEASED["0.5b"] / 1e9
  assert figs["disk_float32_export_s"]["value"] == 4.0
  assert figs["disk_float32_export_s_per_gb"]["value"] == pytest.approx(4.0 / gb32)
  assert figs["disk_bf16_publish_s"]["value"] == 11.0 and figs["disk_bf16_publish_s"]["stats"]["n"] == 3
  assert figs["disk_bf16_update_s_per_gb"]["value"] == pytest.approx(3.0 / gb16)
  # the goals: learner blocked <= 0.3 s/GB on every arm, disk bf16 end to end <= 1.2 s/GB
  assert figs["disk_float32_blocked_s_per_gb"]["goal"] == "<= 0.3" and figs["disk_bf16_publish_s_per_gb"]["goal"] == "<= 1.2"
  assert figs["disk_bf16_publish_s_per_gb"]["goal_met"] is False and figs["disk_float32_publish_s_per_gb"]["goal"] is None
  assert figs["learner_step_s"]["value"] is None and "not measured" in figs["learner_step_s"]["note"]


def test_estimates_scale_with_each_arms_bytes():
  m = _measurement()
  rows = {(r["size"], r["arm"]): r for r in bench_publish.estimates(m, bench_publish.figures(m))}
  for size in RELEASED:
    for arm, itemsize in (("disk float32", 4), ("disk bf16", 2)):
      gb = itemsize * RELEASED[size] / 1e9
      per_gb = 3.5 / (itemsize * RELEASED["0.5b"] / 1e9)
      assert rows[(size, arm)]["gb"] == pytest.approx(gb)
      assert rows[(size, arm)]["pause_s"] == pytest.approx(per_gb * gb)
  section = bench_publish.estimates_section(list(rows.values()), "0.5b") + bench_publish.rounds_section(m)
  assert "| 7b | disk bf16 | 7.616 B | 15.23 |" in section and "moved by up to 0.5 between v0 and v3" in section


def test_arms_are_a_registry_of_publisher_factories():
  assert list(bench_publish.ARMS) == ["disk float32", "disk bf16", "wire bf16 (gloo)", "tensor bf16 (shared memory)"]


@pytest.mark.parametrize("argv, field", [(["--repeats=0"], "--repeats"), (["--arms=wire"], "--arms"),
                                         (["--step-seconds=-1"], "--step-seconds"),
                                         (["--sglang-python=/nonexistent/python"], "--sglang-python")])
def test_bad_arguments_are_refused_with_their_name(argv, field, capsys):
  with pytest.raises(SystemExit):
    bench_publish.main(argv)
  assert field in capsys.readouterr().err
