"""benchmarks/cpu/bench_publish.py at the tiny shape against a real SGLang server: its fields, and the served weights."""
import dataclasses
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
REPEATS = 2  # with the job's keep_versions=3, every version an arm published stays on disk for the recompute
PARTS = ("blocked_s", "publish_s", "export_s", "update_s", "pause_s")
ARMS = ("disk float32", "disk bf16")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("publish")
  out = str(tmp / "results-publish")
  # A float32 server: the served log-probs are then comparable with the learner's recompute of each export.
  argv = [sys.executable, "-m", "benchmarks.cpu.bench_publish", "--shape=tiny", f"--repeats={REPEATS}",
          f"--workdir={tmp / 'work'}", f"--out={out}", f"--sglang-python={SGLANG_PYTHON}",
          "--server-dtype=float32", "--step-seconds=1", f"--arms={','.join(ARMS)}"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1100)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
  with open(out + ".json") as f:
    data = json.load(f)
  with open(out + ".md") as f:
    return data, f.read(), str(tmp / "work")


def _version_dir(work, arm, version):
  return os.path.join(work, "weights", "v0") if version == 0 else \
      os.path.join(work, "arms", arm.replace(" ", "_"), f"v{version}")


def test_figures_and_rounds(result):
  from benchmarks.cpu import bench_publish  # noqa: PLC0415
  from safetensors.numpy import load_file  # noqa: PLC0415
  data, md, work = result
  figs = {f["key"]: f for f in data["figures"]}
  assert list(data["arms"]) == list(ARMS)
  for i, arm in enumerate(ARMS):
    m = data["arms"][arm]
    gb = m["published_bytes"] / 1e9
    for part in PARTS:
      key = f"{bench_publish._slug(arm)}_{part}"
      seconds, per_gb = figs[key], figs[f"{key}_per_gb"]
      assert seconds["error"] is None and seconds["stats"]["n"] == REPEATS
      assert 0 <= seconds["value"] < 600 and math.isclose(per_gb["value"], seconds["value"] / gb, rel_tol=1e-9)
    versions = [r["version"] for r in m["rounds"]]
    assert versions == list(range(1 + i * REPEATS, 1 + (i + 1) * REPEATS))
    for r in m["rounds"]:
      assert r["update_s"] <= r["pause_s"] <= r["publish_s"] and r["blocked_s"] >= r["dispatch_s"]
    # The bytes are the arm's exported tensors, read back independently, in its dtype.
    tensors = load_file(os.path.join(_version_dir(work, arm, versions[-1]), "model.safetensors"))
    assert m["published_bytes"] == sum(t.nbytes for t in tensors.values())
    assert {str(t.dtype) for t in tensors.values()} == {"float32" if arm == "disk float32" else "bfloat16"}
  assert data["arms"]["disk bf16"]["published_bytes"] * 2 == data["arms"]["disk float32"]["published_bytes"]
  assert {(r["size"], r["arm"]) for r in data["estimates"]} == {(s, a) for s in ("0.5b", "1.5b", "7b") for a in ARMS}
  assert figs["learner_step_s"]["value"] is None and "not measured" in figs["learner_step_s"]["note"]
  assert md.splitlines()[2] == f"`{data['command']}`" and "--shape=tiny" in data["command"]


@pytest.mark.parametrize("index", range(len(ARMS)))
def test_served_weights_are_the_published_ones(result, index):
  """Each arm's probe before and after match the learner's float32 recompute of the version served before it
  and of its last export, and the two differ: the server runs the new weights."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from vcpo_jax.model import hf, transformer  # noqa: PLC0415
  data, _, work = result
  arm = ARMS[index]
  probe = data["arms"][arm]["probe"]
  tokens = jnp.asarray([probe["ids"]], jnp.int32)
  before = index * REPEATS  # v0, or the previous arm's last version
  after = before + REPEATS
  recomputed = {}
  for version, owner in ((before, ARMS[index - 1] if index else arm), (after, arm)):
    params, cfg = hf.import_hf(_version_dir(work, owner, version))
    # The served float32 model: a bf16 export's values, exactly, in float32.
    cfg = dataclasses.replace(cfg, param_dtype="float32", dtype="float32")
    params = jax.tree.map(lambda x: np.asarray(x).astype(np.float32), params)
    recomputed[version] = np.asarray(transformer.token_logprobs(params, cfg, tokens, jnp.ones_like(tokens)))[0, 1:]
  assert probe["version_before"] == f"v{before}" and probe["version_after"] == f"v{after}"
  np.testing.assert_allclose(probe["logprobs_before"], recomputed[before], atol=1e-4)
  np.testing.assert_allclose(probe["logprobs_after"], recomputed[after], atol=1e-4)
  assert np.abs(recomputed[before] - recomputed[after]).max() > 1e-2

