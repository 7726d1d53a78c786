"""benchmarks/bench_publish.py without a server: parameter bytes, figures and estimates from a measurement."""
import pytest

from benchmarks import bench_publish
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
  rounds = [{"version": v, "export_s": 2.0 * v, "update_s": 3.0, "pause_s": 3.5, "publish_s": 6.0 + v,
             "update_calls": 1, "served_weight_version": f"v{v}"} for v in (1, 2, 3)]
  return {"shape": "0.5b", "param_dtype": "float32", "exported_bytes": 2_000_000_000, "server_device": "cpu",
          "server_ready_s": 40.0, "rounds": rounds,
          "probe": {"ids": [1, 2, 3], "logprobs_before": [-1.0, -2.0], "logprobs_after": [-1.5, -2.0],
                    "version_before": "v0", "version_after": "v3"}}


def test_figures_are_medians_in_seconds_and_per_gb():
  figs = {f["key"]: f for f in bench_publish.figures(_measurement())}
  assert figs["publish_export_s"]["value"] == 4.0 and figs["publish_export_s_per_gb"]["value"] == 2.0
  assert figs["publish_update_s_per_gb"]["value"] == 1.5 and figs["publish_publish_s"]["stats"]["n"] == 3
  assert figs["learner_step_s"]["value"] is None and "not measured" in figs["learner_step_s"]["note"]


def test_estimates_scale_with_the_parameter_bytes():
  m = _measurement()
  rows = {r["size"]: r for r in bench_publish.estimates(m, bench_publish.figures(m))}
  for size in RELEASED:
    gb = 4 * RELEASED[size] / 1e9
    assert rows[size]["export_s"] == pytest.approx(2.0 * gb) and rows[size]["update_s"] == pytest.approx(1.5 * gb)
  section = bench_publish.estimates_section(list(rows.values()), "0.5b") + bench_publish.rounds_section(m)
  assert "| 7b | 7.616 B | 30.46 |" in section and "moved by up to 0.5 between v0 and v3" in section


@pytest.mark.parametrize("argv, field", [(["--repeats=0"], "--repeats"),
                                         (["--sglang-python=/nonexistent/python"], "--sglang-python")])
def test_bad_arguments_are_refused_with_their_name(argv, field, capsys):
  with pytest.raises(SystemExit):
    bench_publish.main(argv)
  assert field in capsys.readouterr().err
