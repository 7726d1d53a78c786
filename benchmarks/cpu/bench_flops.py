"""Learner FLOP/s over the matmul peak measured in the same run (the job's step; GRPO's MFU) and VCPO / GRPO."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from benchmarks.common import model_choice
from benchmarks.common import records
from benchmarks.common import summary
from benchmarks.common import timing

TITLE = "learner FLOP/s / XLA matmul peak"
GOAL = ">= 0.5"
GRPO_MFU_TITLE = "GRPO step MFU: model FLOP/s (6N*tokens + attention) / matmul peak"
GRPO_MFU_GOAL = ">= 0.45"          # on an H100 (benchmarks/common/goals.py)
VCPO_OVER_GRPO_TITLE = "VCPO / GRPO learner step time (the job's micro-batching)"
VCPO_OVER_GRPO_GOAL = "<= 1.05"    # on an H100 (benchmarks/common/goals.py)


@dataclasses.dataclass(frozen=True)
class FlopsSetup:
  sizes: tuple[int, ...]      # square matmul sizes tried for the peak (grow until a call is slow enough)
  min_call_seconds: float     # stop growing once one matmul call takes this long (it saturates by then)
  warmup: int
  repeats: int


FULL = FlopsSetup(sizes=(256, 512, 1024, 2048, 4096, 8192, 16384), min_call_seconds=0.5, warmup=1, repeats=5)
QUICK = FlopsSetup(sizes=(128, 256, 512), min_call_seconds=0.05, warmup=1, repeats=2)


def matmul_flops(n: int) -> float:
  return 2.0 * n ** 3


def compiled_flops(compiled) -> float | None:
  """'flops' from a compiled executable's cost_analysis() (a dict, or a one-element list in older jax)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - some backends do not implement it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  flops = float(cost["flops"])
  return flops if flops > 0 else None


def matmul_thunk(n: int, dtype: str = "float32", precision: str = "default"):
  """A no-argument call of a jitted n x n matmul (the model's compute dtype and precision) on fixed inputs."""
  import jax
  import jax.numpy as jnp
  ka, kb = jax.random.split(jax.random.key(n))
  a = jax.random.normal(ka, (n, n), dtype)
  b = jax.random.normal(kb, (n, n), dtype)
  matmul = jax.jit(lambda x, y: jnp.matmul(x, y, precision=precision, preferred_element_type=jnp.float32))
  return lambda: matmul(a, b)


def matmul_peak(setup: FlopsSetup, dtype: str = "float32", precision: str = "default") -> tuple[list[int], dict]:
  """Sweeps square float32 matmul sizes; returns the (up to) two best sizes among calls long enough
  (>= 10 ms) for dispatch not to matter, or the two largest if none is, plus the sweep."""
  per_size = {}
  for n in setup.sizes:
    times = timing.time_calls({"mm": matmul_thunk(n, dtype, precision)}, warmup=setup.warmup,
                              repeats=setup.repeats)["mm"]
    st = summary.summarize(times)
    per_size[n] = {"seconds": st.to_dict(), "flop_per_s": matmul_flops(n) / st.median}
    if st.median >= setup.min_call_seconds:
      break
  long_enough = [n for n in per_size if per_size[n]["seconds"]["median"] >= 0.01] or sorted(per_size)[-2:]
  best = sorted(long_enough, key=lambda n: per_size[n]["flop_per_s"])[-2:]
  return best, {"candidate_sizes": best, "sweep": per_size,
                "precision": f"{dtype} inputs, matmul precision {precision!r} (the model's)"}


@dataclasses.dataclass
class LearnerBench:
  """A ready-to-time learner step on a fixed batch; `step()` threads the donated state through calls."""
  step: Callable[[], Any]
  compiled: Any                # the step without micro-batching, compiled for cost analysis (None if not asked)
  analytic_flops: float
  batch_size: int
  seq_len: int
  group_size: int
  describe: dict
  grpo_step: Callable[[], Any] | None = None   # plain GRPO + PPO on the same model, batch and micro-batching
  learner_cfg: Any = None                      # the job's LearnerConfig (the step measured)


def main_job_config():
  """The job whose model and learner are measured: the main CPU job, or the Qwen2.5-0.5B shape (--model)."""
  return model_choice.job_config()


def synthetic_batch(batch: int, seq_len: int, group_size: int, vocab: int, seed: int = 0):
  """Right-padded rows [prompt | response | pad] with stale-ish sampler log-probs and 0/1 rewards."""
  import jax.numpy as jnp
  from vcpo_jax.learner import batch as batch_lib
  rng = np.random.default_rng(seed)
  prompt = seq_len // 4
  end = rng.integers(prompt + seq_len // 4, seq_len + 1, size=batch)
  t = np.arange(seq_len)[None, :]
  mask = ((t >= prompt) & (t < end[:, None])).astype(np.float32)
  tokens = np.where(t < end[:, None], rng.integers(1, vocab, size=(batch, seq_len)), 0).astype(np.int32)
  sampler_logp = (-np.log(vocab) + 0.1 * rng.standard_normal((batch, seq_len))).astype(np.float32) * mask
  return batch_lib.RLBatch(
      tokens_BxT=jnp.asarray(tokens), mask_BxT=jnp.asarray(mask), sampler_logp_BxT=jnp.asarray(sampler_logp),
      rewards_B=jnp.asarray(rng.integers(0, 2, size=batch).astype(np.float32)),
      group_B=jnp.asarray((np.arange(batch) // group_size).astype(np.int32)),
      lag_B=jnp.asarray(rng.integers(0, 3, size=batch).astype(np.int32)))


def matmul_params(model_cfg, params) -> int:
  """Parameters that multiply activations: every kernel (stacked on a layers axis under scan, or one per
  layer), plus the embedding table when it is tied to the LM head (else it is a lookup: no FLOPs)."""
  return sum(int(x.size) for path, x in _flat(params).items()
             if path.endswith("kernel") or (path == "embed_tokens" and model_cfg.tie_word_embeddings))


def analytic_step_flops(model_cfg, params, batch: int, seq_len: int) -> float:
  """Model FLOPs of one forward+backward: 6 * (matmul params) * tokens + causal-free attention 12*L*T^2*H*E*B.

  Per-sequence norms are not counted, so this is the useful work (MFU convention).
  """
  attention = 12.0 * model_cfg.num_layers * seq_len ** 2 * model_cfg.num_heads * model_cfg.head_dim * batch
  return 6.0 * matmul_params(model_cfg, params) * batch * seq_len + attention


def _flat(params) -> dict:
  from flax import traverse_util
  return {"/".join(k): v for k, v in traverse_util.flatten_dict(params).items()}


def grpo_config(lc):
  """Plain GRPO + PPO clipping with the job learner's aggregation and micro-batching (the MFU baseline)."""
  from vcpo_jax.learner import config as learner_config
  return learner_config.LearnerConfig(advantage="grpo", policy_loss="ppo", aggregation=lc.aggregation,
                               micro_batch_size=lc.micro_batch_size)


def _threaded(step_fn, state, batch):
  """A no-argument call that threads the (donated) state through `step_fn`, so repeats are legitimate."""
  holder = {"state": state}

  def step():
    holder["state"], metrics = step_fn(holder["state"], batch)
    return holder["state"], metrics
  return step


def build_learner_bench(*, quick: bool, analyze: bool = True, with_grpo: bool = False) -> LearnerBench:
  """The main job's model, learner (make_rl_step, unsharded) and batch shape, on synthetic data; with_grpo
  also builds the plain GRPO step on the same state shape and batch."""
  from vcpo_jax.learner import train_state
  import jax
  from vcpo_jax.job import configuration
  from vcpo_jax.learner import step as learner
  from vcpo_jax.model import hf
  from vcpo_jax.model import transformer as model_lib
  config = main_job_config()
  model_cfg = hf.model_config(config.model)
  if model_choice.small_model():
    # The main job's learner batch: prompts_per_step * group_size rows padded to model.max_seq_len.
    B, T = (16, 32) if quick else (config.rl.prompts_per_step * config.rl.group_size, model_cfg.max_seq_len)
  else:  # the 0.5B shape: B=64 x T=512 in the job's micro-batches of 8 rows (the goals' shape)
    B, T = (8, 64) if quick else (64, 512)
  G = min(config.rl.group_size, B)
  # Exactly the job's learner: its LearnerConfig (micro-batching included) and optimizer chain.
  lc = configuration.learner_config(config)
  optimizer = configuration.build_optimizer(config)
  batch = synthetic_batch(B, T, G, model_cfg.vocab_size)
  state = train_state.create_train_state(model_cfg, optimizer, jax.random.PRNGKey(0))
  # FLOPs come from the same step without micro-batching (identical arithmetic): XLA's cost_analysis()
  # counts the body of the micro-batch scan once, not once per chunk.
  whole = dataclasses.replace(lc, micro_batch_size=0)
  compiled = jax.jit(lambda s, b: learner.rl_step(s, b, model_cfg=model_cfg, learner_cfg=whole,
                                                  optimizer=optimizer)).lower(state, batch).compile() if analyze else None
  analytic = analytic_step_flops(model_cfg, state.params, B, T)
  step = _threaded(learner.make_rl_step(model_cfg, lc, optimizer), state, batch)
  grpo_step = None
  if with_grpo:
    grpo_state = train_state.create_train_state(model_cfg, optimizer, jax.random.PRNGKey(0))
    grpo_step = _threaded(learner.make_rl_step(model_cfg, grpo_config(lc), optimizer), grpo_state, batch)
  describe = {"shape": f"B={B}, T={T}", "learner_config": dataclasses.asdict(lc),
              "num_params": model_lib.count_params(state.params), "model": model_cfg.to_dict()}
  return LearnerBench(step=step, compiled=compiled, analytic_flops=analytic, batch_size=B, seq_len=T,
                      group_size=G, describe=describe, grpo_step=grpo_step,
                      learner_cfg=lc)


def produce(quick: bool) -> list[dict]:
  return records.run_figure("learner_flops", TITLE, lambda: _measure(quick), goal=GOAL)


def _measure(quick: bool) -> list[dict]:
  setup = QUICK if quick else FULL
  bench = build_learner_bench(quick=quick, with_grpo=True)
  model = bench.describe["model"]
  sizes, peak_details = matmul_peak(setup, model["dtype"], model["matmul_precision"])
  # Side by side: each round times the candidate peak matmuls and the learner step back to back (the
  # machine is shared); the round's peak is its best matmul rate.
  thunks = {f"matmul_{n}": matmul_thunk(n, model["dtype"], model["matmul_precision"]) for n in sizes}
  thunks["step"] = bench.step
  thunks["grpo_step"] = bench.grpo_step
  times = timing.time_calls(thunks, warmup=setup.warmup, repeats=setup.repeats)
  peak_B = [max(matmul_flops(n) / times[f"matmul_{n}"][i] for n in sizes) for i in range(setup.repeats)]
  xla_flops = compiled_flops(bench.compiled)
  analytic = bench.analytic_flops
  flops, source = (xla_flops, "XLA cost_analysis() of the compiled step") if xla_flops else (
      analytic, "analytic 6*N*tokens + attention")
  share = [flops / t / p for t, p in zip(times["step"], peak_B)]
  model_share = [analytic / t / p for t, p in zip(times["step"], peak_B)]
  grpo_mfu = [analytic / t / p for t, p in zip(times["grpo_step"], peak_B)]
  vcpo_over_grpo = summary.ratio_samples(times["step"], times["grpo_step"])
  step, peak = summary.summarize(times["step"]), summary.summarize(peak_B)
  details = {
      "peak_flop_per_s": peak.to_dict(), "peak": peak_details,
      "step_flops": flops, "flops_source": source, "xla_cost_analysis_flops": xla_flops,
      "analytic_flops": analytic, "achieved_flop_per_s": flops / step.median,
      "seconds": timing.timing_details(times), **bench.describe,
  }
  note = (f"{bench.describe['shape']}; {flops / step.median / 1e9:.1f} GFLOP/s vs matmul peak "
          f"{peak.median / 1e9:.1f} GFLOP/s (sizes {sizes}), per-round ratios (FLOPs: {source})")
  return [
      records.figure("learner_flops", TITLE, unit="%", goal=GOAL, stats=summary.summarize(share),
                     details=details, note=note),
      records.figure("learner_model_flops", "learner model FLOP/s (6N*tokens + attention) / XLA matmul peak",
                     unit="%", stats=summary.summarize(model_share),
                     note=f"{bench.describe['shape']}; useful FLOPs only (no per-sequence norm work)"),
      records.figure("grpo_mfu", GRPO_MFU_TITLE, unit="%", goal=GRPO_MFU_GOAL, stats=summary.summarize(grpo_mfu),
                     details={"analytic_flops": analytic, "matmul_peak": f"{model['dtype']} at {model['matmul_precision']!r}",
                              "grpo_learner_config": dataclasses.asdict(grpo_config(bench.learner_cfg))},
                    note=f"{bench.describe['shape']}; model FLOPs 6*N*tokens + attention / GRPO step time / "
                          f"matmul peak, per round (goal set for an H100)"),
      records.figure("learner_vcpo_over_grpo", VCPO_OVER_GRPO_TITLE, unit="x", goal=VCPO_OVER_GRPO_GOAL,
                     stats=summary.summarize(vcpo_over_grpo),
                     note=f"{bench.describe['shape']}; the job's learner vs plain GRPO, same micro-batching, "
                          f"interleaved (goal set for an H100)"),
  ]


if __name__ == "__main__":
  records.module_main(produce, __doc__)
