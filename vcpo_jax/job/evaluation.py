"""Held-out greedy/sampled accuracy, the completions scored by the job's Rewarder."""
from __future__ import annotations

import numpy as np

from vcpo_jax.job import eval_metrics
from vcpo_jax.model import sampling
from vcpo_jax.rollout import episodes


def evaluate(params, model_cfg, tok, task, examples, *, rewarder, max_new_tokens: int, seed: int,
             samples: int = 1) -> dict[str, float]:
  """Greedy and sampled (temperature 1) accuracy on held-out examples, generated in-process; the sampled one
  averages `samples` draws per problem (one standard error shrinks with the draws, not only the problems).
  Also greedy pass@1, avg@n and pass@k (n = samples), per data_source too (job/eval_metrics.py)."""
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
    raise ValueError(f"task.eval_samples must be an int >= 1, got {samples!r}")
  runner = episodes.runner_for(task, tok, max_new_tokens=max_new_tokens)  # tool tasks: multi-turn episodes
  out = {}
  for name, temperature, draws in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
    batch = [e for e in examples for _ in range(draws)]  # a problem's draws side by side
    prompts = [tok.encode(e["prompt"]) for e in batch]
    if runner is None:
      results = sampling.generate(params, model_cfg, prompts, max_new_tokens=max_new_tokens,
                                  temperature=temperature, stop_token_ids=tok.stop_ids, rng=seed)
    else:
      seeds = np.random.default_rng([seed, 0xE7A1]).integers(2**31 - 1, size=len(prompts)).tolist()
      results = runner.run_local(params, model_cfg, prompts, seeds, temperature=temperature, examples=batch)
    rewards = rewarder.score_blocking(batch, [r.output_ids for r in results],
                                      [getattr(r, "env_reward", None) for r in results])
    out[f"eval/{name}_accuracy"] = float(np.mean(rewards))
    # pass@k / avg@n, overall and per data_source (problem id: the position of a problem's draws in `batch`).
    out.update(eval_metrics.aggregate(((e.get("data_source"), i // draws, r) for i, (e, r) in
                                       enumerate(zip(batch, rewards))), greedy=name == "greedy"))
  return out
