"""The jitted RL step: recompute log-probs, IS weights, ESS, registered advantages, one weighted backward."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vcpo_jax.algo import advantages
from vcpo_jax.algo import diagnostics
from vcpo_jax.algo import losses
from vcpo_jax.algo import vcpo
from vcpo_jax.learner import bounded_norms, grad_norms, grad_path, update_diagnostics
from vcpo_jax.learner.batch import RLBatch, check_batch
from vcpo_jax.learner.config import LearnerConfig, check_chunks, chunk_order
from vcpo_jax.learner.train_state import TrainState, apply_update, batch_rows, jit_step, model_args
from vcpo_jax.model import config as model_config
from vcpo_jax.model import remat as remat_lib
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import sharding


def _valid(batch: RLBatch):
  if batch.valid_B is None:
    return jnp.ones(batch.rewards_B.shape, bool)
  return batch.valid_B > 0


def _masked_percentile(x_B, keep_B, q):
  return jnp.nanpercentile(jnp.where(keep_B, x_B, jnp.nan), q)


def _sample_stats(logp_BxT, batch: RLBatch, mask_BxT, valid_B, sq_norms_B, lc: LearnerConfig) -> dict:
  """IS weights, advantages and the estimator's per-row extras (stop-gradient) of the given rows."""
  logp_BxT = jax.lax.stop_gradient(logp_BxT)
  logw_B = vcpo.seq_log_weights(logp_BxT, batch.sampler_logp_BxT, mask_BxT)
  wt_B = vcpo.truncated_weights(logw_B, lc.tis_threshold)
  inputs = advantages.AdvantageInputs(rewards_B=batch.rewards_B.astype(jnp.float32), group_B=batch.group_B,
                                  logw_B=logw_B, wt_B=wt_B, lengths_B=jnp.sum(mask_BxT, axis=-1),
                                  sq_norms_B=sq_norms_B, valid_B=valid_B)
  adv_B, extras = losses.compute_advantages(lc.advantage, inputs, lc.estimator_options())
  return {**extras, "logw_B": logw_B, "wt_B": wt_B, "adv_B": adv_B,  # + numerics apart from lag:
          "mismatch": diagnostics.mismatch_rows(logp_BxT, batch.sampler_logp_BxT, mask_BxT)}


def _policy_loss(logp_BxT, batch: RLBatch, mask_BxT, adv_B, lc: LearnerConfig, max_len=None):
  """Scalar aggregated loss of the registered policy loss (+ optional k3 KL) and its aux metrics."""
  loss_BxT, loss_mask_BxT, aux = losses.policy_loss_terms(
      lc.policy_loss, logp_BxT, batch.sampler_logp_BxT.astype(jnp.float32), mask_BxT,
      jax.lax.stop_gradient(adv_B), lc.loss_options(), prox_logp_BxT=batch.prox_logp_BxT,
      ref_logp_BxT=batch.ref_logp_BxT, kl_beta=lc.kl_beta)
  max_len = lc.generation_budget if max_len is None else max_len
  return losses.aggregate(loss_BxT, loss_mask_BxT, lc.aggregation, max_len=max_len), aux


def _seq_coefficients(logp_BxT, batch, mask_BxT, adv_B, lc: LearnerConfig, max_len):
  """c_i = d loss / d(sum_t m_t log pi_t), read off the registered loss itself (constant over t for losses
  registered with seq_coefficient), so the book-keeping gradient is that loss's gradient."""
  (loss, aux), dlogp_BxT = jax.value_and_grad(
      lambda lp: _policy_loss(lp, batch, mask_BxT, adv_B, lc, max_len), has_aux=True)(logp_BxT)
  c_B = jnp.sum(dlogp_BxT * mask_BxT, axis=-1) / jnp.maximum(jnp.sum(mask_BxT, axis=-1), 1.0)
  return c_B, loss, aux


def _with_reference_logp(batch: RLBatch, ref_params, mask_BxT, model_cfg, lc: LearnerConfig) -> RLBatch:
  """KL needs the reference's log-probs: computed here from the frozen ref params (no server round trip)."""
  if not lc.kl_beta or batch.ref_logp_BxT is not None:
    return batch
  if ref_params is None:
    raise ValueError(f"kl_beta={lc.kl_beta} needs TrainState.ref_params (train_state.with_reference) or "
                     f"RLBatch.ref_logp_BxT")
  ref_BxT = M.token_logprobs(ref_params, model_cfg, batch.tokens_BxT.astype(jnp.int32), mask_BxT)
  return batch.replace(ref_logp_BxT=jax.lax.stop_gradient(ref_BxT.astype(jnp.float32)))


def _loss_and_grads(params, batch: RLBatch, mask_BxT, valid_B, model_cfg, lc: LearnerConfig, ref_params=None,
                    max_len=None, base=None):
  """(loss, grads, stats, ent_BxT, sq_norms_B or None, loss aux) along the path the config selects.

  With LoRA `params` is the adapter and `base` the frozen model: gradients and per-sequence norms are the
  adapter's, and the KL reference is the base with the adapter off."""
  batch = _with_reference_logp(batch, ref_params if base is None else base, mask_BxT, model_cfg, lc)
  tokens = batch.tokens_BxT.astype(jnp.int32)
  model_params, adapter = model_args(params, base)
  if lc.uses_bookkeeping:
    def coef_fn(sq_B, logp_BxT, ent_BxT):
      del ent_BxT
      stats = _sample_stats(logp_BxT, batch, mask_BxT, valid_B, sq_B, lc)
      c_B, loss, aux = _seq_coefficients(logp_BxT, batch, mask_BxT, stats["adv_B"], lc, max_len)
      return c_B, (stats, loss, aux)
    grads, sq_B, gaux = grad_norms.per_sequence_sq_norms_and_grad(
        model_params, model_cfg, tokens, mask_BxT, coef_fn, mode=lc.grad_norm_mode, adapter=adapter)
    stats, loss, aux = gaux["extra"]
    return loss, grads, stats, gaux["ent_BxT"], sq_B, aux
  if lc.needs_grad_norms and lc.grad_path == "bounded":
    # Norms layer by layer, then the registered loss's own dloss/dlogp pulled back through the same forward.
    sq_B, naux, grad_of = bounded_norms.sq_norms_and_vjp(model_params, model_cfg, tokens, mask_BxT,
                                                         mode=lc.grad_norm_mode, adapter=adapter)
    stats = _sample_stats(naux["logp_BxT"], batch, mask_BxT, valid_B, sq_B, lc)
    (loss, aux), dlogp_BxT = jax.value_and_grad(
        lambda lp: _policy_loss(lp, batch, mask_BxT, stats["adv_B"], lc, max_len), has_aux=True)(naux["logp_BxT"])
    return loss, grad_of(dlogp_BxT), stats, naux["ent_BxT"], sq_B, aux

  sq_B = None
  if lc.needs_grad_norms:
    sq_B, _ = grad_norms.per_sequence_sq_norms(model_params, model_cfg, tokens, mask_BxT, mode=lc.grad_norm_mode,
                                               adapter=adapter)

  def loss_fn(p):
    mp, ad = model_args(p, base)
    logp_BxT, ent_BxT = M.token_logprobs_and_entropy(mp, model_cfg, tokens, mask_BxT, adapter=ad)
    stats = _sample_stats(logp_BxT, batch, mask_BxT, valid_B, sq_B, lc)
    loss, aux = _policy_loss(logp_BxT, batch, mask_BxT, stats["adv_B"], lc, max_len)
    return loss, (stats, jax.lax.stop_gradient(ent_BxT), aux)

  (loss, (stats, ent_BxT, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, grads, stats, ent_BxT, sq_B, aux


def _aggregation_denominator(mask_BxT, mode: str):
  """What losses.aggregate divides by over these rows: tokens ('token-mean') or non-empty rows (else)."""
  len_B = jnp.sum(mask_BxT, axis=-1)
  if mode == "token-mean":
    return jnp.maximum(jnp.sum(len_B), 1.0)
  return jnp.maximum(jnp.sum((len_B > 0).astype(jnp.float32)), 1.0)


def _chunked_loss_and_grads(params, batch: RLBatch, mask_BxT, valid_B, model_cfg, lc: LearnerConfig,
                            row_shards: int, ref_params=None, max_len=None, base=None):
  """Same results as _loss_and_grads on the whole batch, computed by a scan over chunks of whole groups."""
  b, micro = mask_BxT.shape[0], lc.micro_batch_size
  order = chunk_order(b, micro, row_shards)
  chunks = jax.tree.map(lambda x: x[order], (batch, mask_BxT, valid_B))
  total_den = _aggregation_denominator(mask_BxT, lc.aggregation)

  def body(acc, chunk):
    cb, cm, cv = chunk
    loss, grads, stats, ent, sq, aux = _loss_and_grads(params, cb, cm, cv, model_cfg, lc, ref_params, max_len,
                                                       base)
    scale = _aggregation_denominator(cm, lc.aggregation) / total_den  # chunk mean -> share of batch mean
    acc = jax.tree.map(lambda a, g: a + scale * g.astype(a.dtype), acc, grads)
    return acc, (loss * scale, stats, ent, sq, aux)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grads, (loss_n, stats, ent, sq, aux) = jax.lax.scan(body, zeros, chunks)
  inverse = np.argsort(order.reshape(-1))
  rows = lambda x: x.reshape((b,) + x.shape[2:])[inverse]
  # Accumulated in float32 and kept so: the optimizer runs in float32 (float32_master) for bf16 params anyway.
  return (jnp.sum(loss_n), grads, jax.tree.map(rows, stats), rows(ent), None if sq is None else rows(sq),
          jax.tree.map(jnp.mean, aux))


def _batch_loss_and_grads(state: TrainState, batch: RLBatch, mask_BxT, valid_B, model_cfg, lc: LearnerConfig,
                          row_shards: int, max_len):
  """_loss_and_grads over the whole batch, in micro-batch chunks when lc asks for them."""
  if lc.micro_batch_size and lc.micro_batch_size < mask_BxT.shape[0]:
    return _chunked_loss_and_grads(state.params, batch, mask_BxT, valid_B, model_cfg, lc, row_shards,
                                   state.ref_params, max_len, state.base)
  return _loss_and_grads(state.params, batch, mask_BxT, valid_B, model_cfg, lc, state.ref_params, max_len,
                         state.base)


def _rl_metrics(loss, grads, stats, ent_BxT, sq_B, aux, batch, mask_BxT, valid_B, lc, lr_scale, ok, state):
  """Flat slash-namespaced step metrics (scalars; hist/* are per-row, NaN on invalid rows)."""
  nan = jnp.float32(jnp.nan)
  logw_B, lag_B = stats["logw_B"], batch.lag_B.astype(jnp.float32)
  n_valid = jnp.maximum(jnp.sum(valid_B), 1)
  valid_mean = lambda x_B: jnp.sum(jnp.where(valid_B, x_B, 0.0)) / n_valid
  tau = lc.tis_threshold
  truncated_B = (logw_B > jnp.log(tau)) if tau is not None else jnp.zeros_like(valid_B)
  metrics = {
      "loss": loss, "grad_norm": optax.tree.norm(grads), "ess": stats["ess"],
      "ess_ratio": stats["ess_ratio"], "lr_scale": lr_scale,
      "is/logw_max": jnp.max(jnp.where(valid_B, logw_B, -jnp.inf)),
      "is/logw_p99": _masked_percentile(logw_B, valid_B, 99.0),
      "is/frac_truncated": jnp.sum(truncated_B & valid_B) / n_valid,
      "is/weight_mean": valid_mean(stats["wt_B"]),
      "entropy": jnp.sum(ent_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0),
      "adv/mean": valid_mean(stats["adv_B"]), "adv/abs_mean": valid_mean(jnp.abs(stats["adv_B"])),
      "lag/mean": valid_mean(lag_B), "lag/max": jnp.max(jnp.where(valid_B, lag_B, -jnp.inf)),
      "skipped_updates": state.skipped_updates, "update_applied": ok.astype(jnp.float32),
      "hist/logw_B": jnp.where(valid_B, logw_B, nan), "hist/lag_B": jnp.where(valid_B, lag_B, nan),
  }
  for key, x_B in stats.items():  # the estimator's per-row extras, e.g. OPOB's baseline_B -> "baseline"
    if key.endswith("_B") and key not in ("logw_B", "wt_B", "adv_B", "opob_logW_B"):
      metrics[key[:-2]] = valid_mean(x_B)
  if "opob_logW_B" in stats:  # over the whole batch, after any micro-batch scan: groups never straddle chunks
    metrics.update(vcpo.opob_moment_diagnostics(batch.rewards_B, batch.group_B, stats["opob_logW_B"],
                                                stats["baseline_B"], valid_B))
  if sq_B is not None:
    norm_B = jnp.sqrt(sq_B)
    for q in (10, 50, 90):
      metrics[f"seq_grad_norm/p{q}"] = _masked_percentile(norm_B, valid_B, float(q))
    metrics["seq_grad_norm/max"] = jnp.max(jnp.where(valid_B, norm_B, -jnp.inf))
    metrics["hist/seq_grad_norm_B"] = jnp.where(valid_B, norm_B, nan)
  if "kl_k3" in aux:
    metrics["kl/mean"] = aux["kl_k3"]  # k3 estimate of KL(pi || ref), token mean over the loss mask
  metrics.update({f"loss/{k}": v for k, v in aux.items()})
  metrics.update(diagnostics.mismatch_from_rows(stats["mismatch"], lag_B, valid_B))  # docs/gpu.md reads them
  return metrics


def rl_step(state: TrainState, batch: RLBatch, *, model_cfg: model_config.ModelConfig, learner_cfg: LearnerConfig,
            optimizer: optax.GradientTransformationExtraArgs, row_shards: int = 1):
  """One RL update (pure): recompute log-probs, IS weights, ESS, advantages, weighted gradient, optimizer.

  row_shards: how many data shards the rows are split over (only orders micro-batch chunks).
  """
  lc = learner_cfg
  valid_B = _valid(batch)
  mask_BxT = batch.mask_BxT.astype(jnp.float32) * valid_B[:, None].astype(jnp.float32)
  max_len = lc.generation_budget  # Dr.GRPO's constant normalizer (rl.max_new_tokens), the same in every chunk
  micro = lc.micro_batch_size if lc.micro_batch_size and lc.micro_batch_size < mask_BxT.shape[0] else 0
  # 'auto' resolved here, once per trace, from the shapes the step really gets (logged: the start-up choice).
  path = grad_path.log_choice(lc, model_cfg, micro or mask_BxT.shape[0], mask_BxT.shape[1], row_shards)
  if path in ("book_keeping", "bounded"):
    lc = dataclasses.replace(lc, grad_path=path)
  # model.remat='auto' likewise: the cheapest policy whose estimate (state, a micro-batch accumulator) fits.
  model_cfg = remat_lib.resolve(model_cfg, -(-(micro or mask_BxT.shape[0]) // row_shards), mask_BxT.shape[1],
                                remat_lib.state_bytes_per_device(state, grad_copies=2 if micro else 1))
  loss, grads, stats, ent_BxT, sq_B, aux = _batch_loss_and_grads(state, batch, mask_BxT, valid_B, model_cfg, lc,
                                                                 row_shards, max_len)
  stats["ess"] = vcpo.ess(stats["logw_B"], valid_B)
  stats["ess_ratio"] = vcpo.ess_ratio(stats["logw_B"], valid_B)
  # A NaN reward can be absorbed silently (e.g. a NaN group std reads as "std 0" -> advantage 0), so
  # corrupt inputs are checked directly rather than only through the gradient.
  inputs_ok = (jnp.all(jnp.isfinite(batch.rewards_B) | ~valid_B)
               & jnp.all(jnp.isfinite(batch.sampler_logp_BxT) | (mask_BxT == 0)))
  new_state, ok, lr_scale = apply_update(state, grads, loss, optimizer, stats["ess_ratio"], stats["ess"],
                                         inputs_ok)
  metrics = _rl_metrics(loss, grads, stats, ent_BxT, sq_B, aux, batch, mask_BxT, valid_B, lc, lr_scale, ok,
                        new_state)
  if lc.update_diagnostics:
    # The update the same step would take with group-mean advantages: one more backward pass, then the same
    # optimizer state and ESS arguments (the state itself moves only by the arm's own update, above).
    gm_grads = _batch_loss_and_grads(state, batch, mask_BxT, valid_B, model_cfg,
                                     update_diagnostics.group_mean_config(lc), row_shards, max_len)[1]
    step_of = lambda g: optimizer.update(g, state.opt_state, state.params, ess_ratio=stats["ess_ratio"],  # noqa: E731
                                         ess=stats["ess"])[0]
    metrics.update(update_diagnostics.metrics(grads, gm_grads, step_of(grads), step_of(gm_grads)))
  return new_state, metrics


def make_rl_step(model_cfg: model_config.ModelConfig, learner_cfg: LearnerConfig, optimizer, mesh=None,
                 rules=sharding.DEFAULT_RULES):
  """`step(state, batch) -> (state, metrics)`, jitted once (state donated; shardings when a mesh is given).
  With learner_cfg.kl_beta > 0 the state must carry ref_params (train_state.with_reference), unless model.lora
  is on (the reference is the base with the adapter off)."""
  shards = batch_rows(mesh)

  def fn(state, batch):
    # Every dot traced here, the per-sequence norms' einsums included, runs at the model's precision: on GPUs
    # float32 dots default to TF32, which moves log-probs (and so importance ratios) by ~1e-3.
    with jax.default_matmul_precision(model_cfg.matmul_precision):
      return rl_step(state, batch, model_cfg=model_cfg, learner_cfg=learner_cfg, optimizer=optimizer,
                     row_shards=shards)

  def check(batch):
    check_batch(batch)
    check_chunks(batch, learner_cfg.micro_batch_size, shards)
  # With LoRA the KL reference is the frozen base: the state carries no reference copy.
  return jit_step(fn, model_cfg, optimizer, mesh, rules, check,
                  with_ref=learner_cfg.kl_beta > 0 and not model_cfg.lora.rank)
