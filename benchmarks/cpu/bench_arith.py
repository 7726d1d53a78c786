"""Figure 6: ESS + OPOB baseline arithmetic (jitted vcpo.* on the step's batch) as a share of the VCPO step time."""
from __future__ import annotations

import functools

import jax
import numpy as np

from benchmarks.cpu import bench_flops
from benchmarks.common import records
from benchmarks.common import summary
from benchmarks.common import timing

TITLE = "ESS + OPOB arithmetic / VCPO step time"
GOAL = "< 0.01"


@functools.partial(jax.jit, static_argnames=("tau",))
def vcpo_arithmetic(logp_BxT, sampler_logp_BxT, mask_BxT, rewards_B, group_B, sq_norms_B, *, tau=8.0):
  """What VCPO adds on top of a plain step, given log-probs and per-sequence norms: IS weights, ESS, OPOB."""
  from vcpo_jax.algo import vcpo
  logw_B = vcpo.seq_log_weights(logp_BxT, sampler_logp_BxT, mask_BxT)
  wt_B = vcpo.truncated_weights(logw_B, tau)
  rho = vcpo.ess_ratio(logw_B)
  lengths_B = mask_BxT.sum(axis=-1)
  adv_B, _ = vcpo.opob_advantages(rewards_B, group_B, sq_norms_B, logw_B, wt_B, lengths_B, scope="group",
                                  is_weight="raw", normalize_by_length=False, aggregation="mean",
                                  norm_by_std=True)
  return adv_B, wt_B, rho


def arithmetic_inputs(batch: int, seq_len: int, group_size: int, seed: int = 0):
  """A batch like a real step's: half-prompt masks, sampler log-probs near the learner's, 0/1 rewards."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  logp = -rng.exponential(1.0, (batch, seq_len)).astype(np.float32)
  sampler_logp = (logp + 0.05 * rng.standard_normal((batch, seq_len))).astype(np.float32)
  start = rng.integers(seq_len // 4, seq_len // 2, size=batch)
  stop = rng.integers(seq_len // 2 + 1, seq_len + 1, size=batch)
  t = np.arange(seq_len)[None, :]
  mask = ((t >= start[:, None]) & (t < stop[:, None])).astype(np.float32)
  rewards = rng.integers(0, 2, size=batch).astype(np.float32)
  groups = (np.arange(batch) // group_size).astype(np.int32)
  sq_norms = rng.lognormal(0.0, 1.0, size=batch).astype(np.float32)
  return tuple(jnp.asarray(x) for x in (logp, sampler_logp, mask, rewards, groups, sq_norms))


def produce(quick: bool) -> list[dict]:
  return records.run_figure("vcpo_arith_share", TITLE, lambda: _measure(quick), goal=GOAL)


def _measure(quick: bool) -> list[dict]:
  bench = bench_flops.build_learner_bench(quick=quick, analyze=False)
  B, T = bench.batch_size, bench.seq_len
  inputs = arithmetic_inputs(B, T, bench.group_size)
  arith = lambda: vcpo_arithmetic(*inputs)
  # The arithmetic is microseconds: time a loop of calls so the timer's resolution does not matter.
  inner = 20 if quick else 200

  def arith_loop():
    out = None
    for _ in range(inner):
      out = arith()
    return out

  warmup, repeats = (1, 3) if quick else (2, 7)
  times = timing.time_calls({"arith_x%d" % inner: arith_loop, "step": bench.step}, warmup=warmup,
                            repeats=repeats)
  arith_times = [t / inner for t in times["arith_x%d" % inner]]
  share = summary.summarize(summary.ratio_samples(arith_times, times["step"]))
  arith_flops = bench_flops.compiled_flops(vcpo_arithmetic.lower(*inputs).compile())
  step_flops = bench.analytic_flops
  details = {
      "arith_seconds_per_call": summary.summarize(arith_times).to_dict(),
      "step_seconds": summary.summarize(times["step"]).to_dict(),
      "arith_flops": arith_flops, "step_model_flops_analytic": step_flops,
      "flops_share": (arith_flops / step_flops) if arith_flops and step_flops else None,
      "timed": "seq_log_weights + truncated_weights + ess_ratio + opob_advantages(group, raw, mean, std) "
               "as one separate jitted call (dispatch included: an upper bound on its cost inside the step)",
      **bench.describe,
  }
  return [records.figure("vcpo_arith_share", TITLE, unit="%", goal=GOAL, stats=share, details=details,
                         note=f"{bench.describe['shape']}; separate jitted call incl. dispatch")]


if __name__ == "__main__":
  records.module_main(produce, __doc__)
