"""benchmarks/bench_publish.py at the tiny shape against a real SGLang server: its fields, and the served weights."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.sglang.conftest import REPO, SGLANG_PYTHON, requires_sglang

pytestmark = [pytest.mark.sglang, requires_sglang, pytest.mark.integration, pytest.mark.slow,
              pytest.mark.timeout(1200)]
REPEATS = 2  # with the job's keep_versions=3, v0 .. v2 stay on disk for the recompute
PARTS = ("export_s", "update_s", "pause_s", "publish_s")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("publish")
  out = str(tmp / "results-publish")
  argv = [sys.executable, "-m", "benchmarks.bench_publish", "--shape=tiny", f"--repeats={REPEATS}",
          f"--workdir={tmp / 'work'}", f"--out={out}", f"--sglang-python={SGLANG_PYTHON}"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1100)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
  with open(out + ".json") as f:
    data = json.load(f)
  with open(out + ".md") as f:
    return data, f.read(), str(tmp / "work" / "weights")


def test_figures_and_rounds(result):
  data, md, root = result
  figs = {f["key"]: f for f in data["figures"]}
  gb = data["exported_bytes"] / 1e9
  for part in PARTS:
    seconds, per_gb = figs[f"publish_{part}"], figs[f"publish_{part}_per_gb"]
    assert seconds["error"] is None and seconds["stats"]["n"] == REPEATS
    assert 0 < seconds["value"] < 600 and math.isclose(per_gb["value"], seconds["value"] / gb, rel_tol=1e-9)
  assert figs["learner_step_s"]["value"] is None and "not measured" in figs["learner_step_s"]["note"]
  assert [r["version"] for r in data["rounds"]] == list(range(1, REPEATS + 1))
  for r in data["rounds"]:
    assert r["served_weight_version"] == f"v{r['version']}" and r["update_calls"] >= 1
    assert r["update_s"] <= r["pause_s"] <= r["publish_s"]
  # The bytes are the exported tensors' (read back independently) plus a little JSON.
  from safetensors.numpy import load_file  # noqa: PLC0415
  tensors = load_file(os.path.join(root, "v0", "model.safetensors"))
  assert data["param_bytes"] == sum(t.nbytes for t in tensors.values())
  assert data["param_count"] == sum(t.size for t in tensors.values())
  assert data["param_bytes"] <= data["exported_bytes"] < data["param_bytes"] + 2_000_000
  assert {r["size"] for r in data["estimates"]} == {"0.5b", "1.5b", "7b"}
  assert md.splitlines()[2] == f"`{data['command']}`" and "--shape=tiny" in data["command"]


def test_served_weights_are_the_published_ones(result):
  """The probe's served log-probs before and after match the learner's float32 recompute of v0 and the last
  version's exported weights, and the two differ: the server runs the new weights."""
  import jax.numpy as jnp  # noqa: PLC0415
  from vcpo_jax.model import hf, transformer  # noqa: PLC0415
  data, _, root = result
  probe = data["probe"]
  tokens = jnp.asarray([probe["ids"]], jnp.int32)
  recomputed = {}
  for version in (0, REPEATS):
    params, cfg = hf.import_hf(os.path.join(root, f"v{version}"))
    recomputed[version] = np.asarray(transformer.token_logprobs(params, cfg, tokens, jnp.ones_like(tokens)))[0, 1:]
  assert probe["version_before"] == "v0" and probe["version_after"] == f"v{REPEATS}"
  np.testing.assert_allclose(probe["logprobs_before"], recomputed[0], atol=1e-4)
  np.testing.assert_allclose(probe["logprobs_after"], recomputed[REPEATS], atol=1e-4)
  assert np.abs(recomputed[0] - recomputed[REPEATS]).max() > 1e-2
