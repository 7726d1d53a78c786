"""The main job's emulated 3-step run along the book-keeping and bounded gradient paths gives the same metrics
(two_pass is the same step as book_keeping with a second backward: tests/test_grad_path.py checks its learner step
against both)."""
import json
import os

import numpy as np
import pytest

from configs import tiny
from vcpo_jax.job import train

pytestmark = [pytest.mark.slow]
# Metrics that depend on the per-sequence norms (baseline, seq_grad_norm/*) and on the gradient itself.
KEYS = ("loss", "grad_norm", "ess", "baseline", "seq_grad_norm/p50", "seq_grad_norm/max", "entropy")


def _metrics(workdir, path: str):
  c = tiny.get_config("emulate")
  c.sft.steps = 0          # the paths differ only in the RL step
  c.eval_every = 100       # no evaluation inside the 3 steps
  c.algo.grad_path = path
  train.train_and_evaluate(c, str(workdir))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_emulated_job_metrics_agree_across_paths(tmp_path):
  runs = {p: _metrics(tmp_path / p, p) for p in ("book_keeping", "bounded")}
  want = runs["book_keeping"]
  assert len(want) == 3
  for path in ("bounded",):
    assert len(runs[path]) == len(want)
    for step, (got, ref) in enumerate(zip(runs[path], want)):
      for key in KEYS:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=f"{path} step {step} {key}")
