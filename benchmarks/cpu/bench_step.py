"""Learner step cost side by side: plain GRPO, VCPO (book-keeping, bounded), two-pass VCPO, micro-batch-1 oracle."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import model_choice
from benchmarks.common import oracle
from benchmarks.common import records
from benchmarks.common import summary
from benchmarks.common import timing
from vcpo_jax.algo import vcpo
from vcpo_jax.learner import batch as batch_lib
from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M

# The main CPU job's model (configs/countdown.py) at max_seq_len 256; B = 8 prompts x 8 samples.
MODEL = model_config.ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_seq_len=256)
GROUP = 8
# (B, T, micro-batch rows) per model and mode. On the 0.5B shape a whole-batch step holds [B*T, 151936]
# float32 logits and their gradients (~4.6 kB per token per copy), so its batch stays at 4,096 tokens.
SIZES = {("main", False): (64, 128, 8), ("main", True): (16, 64, 8),
         ("tiny", False): (16, 64, 8), ("tiny", True): (16, 32, 8),
         ("qwen2.5-0.5b", False): (16, 256, 8), ("qwen2.5-0.5b", True): (8, 64, 8)}


def bench_model(name: str) -> model_config.ModelConfig:
  if name == "main":
    return MODEL
  import dataclasses
  cfg = model_choice.model_config(name)
  return dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, 256))


def make_batch(cfg: model_config.ModelConfig, params, b: int, t: int, seed: int = 0) -> batch_lib.RLBatch:
  """Right-padded rows: prompts of 16-32 tokens, responses up to the end, sampler log-probs a little stale."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, cfg.vocab_size, (b, t)).astype(np.int32)
  prompt = rng.integers(16, 33, b)
  end = np.minimum(t, prompt + rng.integers(t // 4, t - 16, b))
  pos = np.arange(t)[None, :]
  mask = ((pos >= prompt[:, None]) & (pos < end[:, None])).astype(np.float32)
  tokens = np.where(pos < end[:, None], tokens, 0).astype(np.int32)
  logp = np.asarray(jax.jit(functools.partial(M.token_logprobs, cfg=cfg))(params, tokens_BxT=tokens,
                                                                           mask_BxT=mask))
  sampler = (logp + 0.05 * rng.standard_normal((b, t))) * mask
  return batch_lib.RLBatch(tokens_BxT=tokens, mask_BxT=mask, sampler_logp_BxT=sampler.astype(np.float32),
                    rewards_B=rng.integers(0, 2, b).astype(np.float32),
                    group_B=np.repeat(np.arange(b // GROUP), GROUP).astype(np.int32),
                    lag_B=rng.integers(0, 3, b).astype(np.float32), valid_B=np.ones(b, np.float32))


def _jit_rl(cfg, lc, opt):
  return jax.jit(functools.partial(Lr.rl_step, model_cfg=cfg, learner_cfg=lc, optimizer=opt), donate_argnums=0)


def _oracle_step(state: train_state.TrainState, batch: batch_lib.RLBatch, *, cfg, opt, tau: float = 8.0):
  """Micro-batch-1 VCPO update: per-sequence backward loop, then the same ESS-scaled optimizer step."""
  grads, stats = oracle.oracle_grads(state.params, cfg, batch.tokens_BxT, batch.mask_BxT,
                                     batch.sampler_logp_BxT, batch.rewards_B, GROUP, tau=tau)
  logw_B = stats["logw_B"]
  updates, opt_state = opt.update(grads, state.opt_state, state.params, ess_ratio=vcpo.ess_ratio(logw_B),
                                  ess=vcpo.ess(logw_B))
  return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                       opt_state=opt_state), stats


def _arith(batch: batch_lib.RLBatch, logw_B, sq_B, tau: float = 8.0):
  """The ESS + OPOB arithmetic of one step, alone (given log-weights and per-sequence norms)."""
  wt_B = vcpo.truncated_weights(logw_B, tau)
  lengths_B = jnp.sum(batch.mask_BxT, axis=1)
  adv_B, _ = vcpo.opob_advantages(batch.rewards_B, batch.group_B, sq_B, logw_B, wt_B, lengths_B,
                                  valid_B=batch.valid_B > 0)
  return adv_B, vcpo.ess(logw_B, batch.valid_B > 0), vcpo.ess_ratio(logw_B, batch.valid_B > 0)


def _memory(compiled) -> dict:
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  out = {k: int(getattr(mem, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                            "output_size_in_bytes", "alias_size_in_bytes")
         if hasattr(mem, k)}
  out["peak_estimate_bytes"] = (out.get("temp_size_in_bytes", 0) + out.get("argument_size_in_bytes", 0)
                                + out.get("output_size_in_bytes", 0) - out.get("alias_size_in_bytes", 0))
  return out


class _Runner:
  """A thunk that advances its own (donated) state each call, so repeated timing is legitimate."""

  def __init__(self, fn, state, batch):
    self.fn, self.state, self.batch = fn, state, batch

  def __call__(self):
    self.state, metrics = self.fn(self.state, self.batch)
    return self.state, metrics


def produce(quick: bool) -> list[dict]:
  name = model_choice.resolve_model()
  b, t, micro = SIZES[(name, quick)]
  repeats = 2 if quick else 4
  cfg = bench_model(name)
  opt = O.build_optimizer(learning_rate=1e-5)
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  batch = jax.device_put(make_batch(cfg, params, b, t))
  fresh = lambda: train_state.TrainState(step=jnp.zeros((), jnp.int32), params=jax.tree.map(jnp.copy, params),
                                opt_state=opt.init(params), skipped_updates=jnp.zeros((), jnp.int32))
  configs = {
      "grpo": learner_config.LearnerConfig(advantage="grpo", policy_loss="ppo"),
      "vcpo": learner_config.LearnerConfig(grad_path="book_keeping"),
      "bounded": learner_config.LearnerConfig(grad_path="bounded"),
      "two_pass": learner_config.LearnerConfig(grad_path="two_pass"),
      "grpo_mb": learner_config.LearnerConfig(advantage="grpo", policy_loss="ppo", micro_batch_size=micro),
      "vcpo_mb": learner_config.LearnerConfig(grad_path="book_keeping", micro_batch_size=micro),
  }
  jitted = {name: _jit_rl(cfg, lc, opt) for name, lc in configs.items()}
  jitted["oracle"] = jax.jit(functools.partial(_oracle_step, cfg=cfg, opt=opt), donate_argnums=0)
  # One compilation each: the compiled executable is both measured (memory) and timed.
  compiled = {name: fn.lower(fresh(), batch).compile() for name, fn in jitted.items()}
  memory = {name: _memory(compiled[name]) for name in configs}
  runners = {name: _Runner(fn, fresh(), batch) for name, fn in compiled.items()}

  # Inputs of the arithmetic-only timing, from one VCPO step.
  _, m = compiled["vcpo"](fresh(), batch)
  logw_B = jnp.asarray(m["hist/logw_B"])
  sq_B = jnp.square(jnp.asarray(m["hist/seq_grad_norm_B"]))
  arith = jax.jit(_arith)
  runners["arith"] = lambda: arith(batch, logw_B, sq_B)

  times = timing.time_calls(runners, warmup=1, repeats=repeats)
  ratio = lambda a, c: summary.summarize(summary.ratio_samples(times[a], times[c]))
  shape = {"B": b, "T": t, "params": M.count_params(params), "group": GROUP, "micro_batch_size": micro,
           "backend": jax.default_backend(), "model": name, "dtype": cfg.dtype}
  peak = lambda name: memory[name].get("peak_estimate_bytes")
  mem_ratio = peak("vcpo") / peak("grpo") if peak("vcpo") and peak("grpo") else None
  return [
      records.figure("step_vcpo_over_grpo", "VCPO step (ESS + group OPOB, book-keeping) / plain GRPO step",
                     unit="x", goal="<= 1.3", stats=ratio("vcpo", "grpo"),
                     details={**shape, "seconds": timing.timing_details(times)}),
      records.figure("step_bounded_over_grpo", "bounded VCPO step (norms layer by layer + backward) / GRPO step",
                     unit="x", goal="<= 1.6", stats=ratio("bounded", "grpo"), details=shape),
      records.figure("step_two_pass_over_grpo", "two-pass VCPO step (norm pass + backward) / plain GRPO step",
                     unit="x", goal="<= 1.8", stats=ratio("two_pass", "grpo"), details=shape),
      records.figure("step_oracle_over_vcpo", "micro-batch-1 oracle step / VCPO step", unit="x", goal=">= 4",
                     stats=ratio("oracle", "vcpo"), details=shape,
                     note="on CPU a batch-1 backward is not starved (T=128 rows per matmul) and fits cache"),
      records.figure("step_vcpo_mb_over_grpo_mb", "VCPO / GRPO step, both in micro-batches of whole groups",
                     unit="x", goal="<= 1.3", stats=ratio("vcpo_mb", "grpo_mb"), details=shape),
      records.figure("step_vcpo_mb_over_vcpo", "VCPO step in micro-batches / VCPO step on the whole batch",
                     unit="x", stats=ratio("vcpo_mb", "vcpo"), details=shape),
      records.figure("step_oracle_over_vcpo_mb", "micro-batch-1 oracle step / VCPO step in micro-batches",
                     unit="x", goal=">= 4", stats=ratio("oracle", "vcpo_mb"), details=shape),
      records.figure("step_arith_share", "ESS + OPOB arithmetic / VCPO step time", unit="%", goal="< 0.01",
                     stats=ratio("arith", "vcpo"), details=shape),
      records.figure("step_memory_vcpo_over_grpo", "VCPO step / GRPO step compiled memory (temp+args+out-alias)",
                     unit="x", value=mem_ratio, details={**shape, **{f"memory_{k}": v for k, v in memory.items()}},
                     note="XLA memory_analysis() of the compiled steps"),
  ]


def main(argv=None):
  return records.module_main(produce, __doc__, argv)


if __name__ == "__main__":
  main()
