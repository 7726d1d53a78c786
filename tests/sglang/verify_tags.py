"""Recomputes every logged rollout token under the exported weights its version tag names (learner, float32).

  python -m tests.sglang.verify_tags SAMPLE_LOG WEIGHTS_ROOT      # prints the worst |gap| and the counts
"""
import json
import os
import sys

import numpy as np


def worst_gap(sample_log: str, weights_root: str) -> dict:
  """{"worst": max |server lp - learner lp| over all tokens, "tokens", "samples", "straddling", "versions"}."""
  import jax.numpy as jnp  # noqa: PLC0415
  from vcpo_jax.model import hf  # noqa: PLC0415
  from vcpo_jax.model import transformer as model
  with open(sample_log) as f:
    samples = [json.loads(line) for line in f if line.strip()]
  by_version: dict[int, list] = {}
  for s in samples:
    for v in set(s["versions"]):
      by_version.setdefault(v, []).append(s)
  worst, tokens = 0.0, 0
  for v, group in sorted(by_version.items()):
    params, cfg = hf.import_hf(os.path.join(weights_root, f"v{v}"))
    for s in group:
      seq = s["prompt_ids"] + s["output_ids"]
      toks = jnp.asarray(np.array([seq + [0] * (cfg.max_seq_len - len(seq))], np.int32))
      lp = np.asarray(model.token_logprobs(params, cfg, toks, jnp.ones_like(toks)))[0]
      ref = lp[len(s["prompt_ids"]):len(seq)]
      at = np.asarray(s["versions"]) == v
      worst = max(worst, float(np.abs(np.asarray(s["logprobs"])[at] - ref[at]).max()))
      tokens += int(at.sum())
  return {"worst": worst, "tokens": tokens, "samples": len(samples), "versions": len(by_version),
          "straddling": sum(len(set(s["versions"])) > 1 for s in samples),
          "resumed": sum(s["resumes"] > 0 for s in samples)}


if __name__ == "__main__":
  print(json.dumps(worst_gap(sys.argv[1], sys.argv[2])))
