"""Train state, the jitted RL step (IS weights, ESS, OPOB, one weighted backward) and the SFT step."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from vcpo_jax import grad_norms, losses, model as M, optimizer as optimizer_lib, sharding, vcpo
from vcpo_jax.batch import RLBatch, check_batch  # noqa: F401  (re-exported for callers of learner.RLBatch)

# Policy losses whose gradient is sum_i c_i grad sum_t m_t log pi(y_t) with stop-gradient per-sequence c_i:
# for these the book-keeping path gives norms and the weighted gradient from one backward.
SEQ_SCALAR_LOSSES = ("vcpo", "seq_tis", "topr")
GRAD_PATHS = ("auto", "two_pass")
_TAU_LOSSES = ("vcpo", "seq_tis")
# Micro-batching is exact when advantages are group-local and the loss has no batch-global statistic.
GROUP_LOCAL_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "opob")
BATCH_GLOBAL_LOSSES = ("m2po",)


# ---------------------------------------------------------------------------------------------- data types
@flax.struct.dataclass
class TrainState:
  step: jax.Array              # int32, learner steps taken (skipped ones included)
  params: Any
  opt_state: Any
  skipped_updates: jax.Array   # int32, steps whose loss or gradient was not finite (update not applied)


def check_chunks(batch: RLBatch, micro_batch_size: int, row_shards: int = 1):
  """Host-side: micro-batch chunks (see _chunk_order) must hold whole prompt groups."""
  b = batch.tokens_BxT.shape[0]
  if not micro_batch_size or micro_batch_size >= b:
    return
  if b % micro_batch_size or micro_batch_size % row_shards:
    raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch rows B={b} and be a multiple "
                     f"of the data shards ({row_shards})")
  chunk_of_row = np.empty(b, np.int64)
  chunk_of_row[_chunk_order(b, micro_batch_size, row_shards).reshape(-1)] = np.repeat(
      np.arange(b // micro_batch_size), micro_batch_size)
  groups = np.asarray(batch.group_B)
  for g in np.unique(groups):
    if len(np.unique(chunk_of_row[groups == g])) > 1:
      raise ValueError(f"micro_batch_size={micro_batch_size} splits prompt group {g} across chunks; groups must "
                       f"be contiguous rows and the group size must divide micro_batch_size / data shards")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """What the RL step computes; names refer to the registries in losses.py (plain values, no ml_collections)."""
  advantage: str = "opob"
  advantage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  opob: Mapping[str, Any] = dataclasses.field(default_factory=dict)     # vcpo.OPOBOptions fields
  policy_loss: str = "vcpo"
  policy_loss_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  aggregation: str = "seq-mean-token-mean"
  tis_threshold: Optional[float] = 8.0     # tau of the truncated sequence weights (loss 'vcpo' and OPOB)
  kl_beta: float = 0.0
  grad_path: str = "auto"                  # 'auto': book-keeping when possible; 'two_pass': norms, then backward
  grad_norm_mode: str = "auto"             # grad_norms mode: 'auto' | 'ghost' | 'explicit'
  micro_batch_size: int = 0                # > 0: rows processed in chunks of whole groups (scan); 0: at once

  def __post_init__(self):
    # Option mappings are frozen to sorted (key, value) tuples so the config is hashable (a cache key).
    for name in ("advantage_options", "opob", "policy_loss_options"):
      object.__setattr__(self, name, _frozen_items(getattr(self, name), name))
    losses.get_advantage_fn(self.advantage)
    losses.get_policy_loss(self.policy_loss)
    if self.aggregation not in losses.AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {losses.AGGREGATIONS}, got aggregation={self.aggregation!r}")
    if self.tis_threshold is not None and not self.tis_threshold > 0:
      raise ValueError(f"tis_threshold must be positive or None, got tis_threshold={self.tis_threshold!r}")
    if not self.kl_beta >= 0:
      raise ValueError(f"kl_beta must be >= 0, got kl_beta={self.kl_beta!r}")
    if self.grad_path not in GRAD_PATHS:
      raise ValueError(f"grad_path must be one of {GRAD_PATHS}, got grad_path={self.grad_path!r}")
    if self.grad_norm_mode not in grad_norms.MODES:
      raise ValueError(f"grad_norm_mode must be one of {grad_norms.MODES}, got {self.grad_norm_mode!r}")
    vcpo.OPOBOptions(**dict(self.opob))
    if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 0:
      raise ValueError(f"micro_batch_size must be an int >= 0, got micro_batch_size={self.micro_batch_size!r}")
    if self.micro_batch_size and not self.chunkable:
      raise ValueError(
          f"micro_batch_size={self.micro_batch_size} needs statistics local to prompt groups: advantage one of "
          f"{GROUP_LOCAL_ADVANTAGES} (opob with scope='group') and a policy loss other than {BATCH_GLOBAL_LOSSES}; "
          f"got advantage={self.advantage!r}, policy_loss={self.policy_loss!r}")

  @property
  def chunkable(self) -> bool:
    """Whether each row's advantage and loss depend only on its own group (so chunks of groups are exact)."""
    local = self.advantage in GROUP_LOCAL_ADVANTAGES and (
        self.advantage != "opob" or self.opob_options().scope == "group")
    return local and self.policy_loss not in BATCH_GLOBAL_LOSSES

  def opob_options(self) -> vcpo.OPOBOptions:
    return vcpo.OPOBOptions(**dict(self.opob))

  @property
  def needs_grad_norms(self) -> bool:
    return losses.needs_grad_norms(self.advantage)

  @property
  def uses_bookkeeping(self) -> bool:
    return (self.needs_grad_norms and self.grad_path == "auto" and self.policy_loss in SEQ_SCALAR_LOSSES
            and not self.kl_beta)

  def estimator_options(self) -> dict:
    return dict(self.advantage_options)

  def loss_options(self) -> dict:
    opts = dict(self.policy_loss_options)
    if self.policy_loss in _TAU_LOSSES:
      opts.setdefault("tau", self.tis_threshold)
    return opts


def _frozen_items(options, field: str) -> tuple:
  if isinstance(options, tuple):
    options = dict(options)
  if not isinstance(options, Mapping):
    raise ValueError(f"LearnerConfig.{field} must be a mapping of options, got {field}={options!r}")
  return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in dict(options).items()))


# ---------------------------------------------------------------------------------------------- state
def _init_state(model_cfg: M.ModelConfig, optimizer, rng, boxed: bool) -> TrainState:
  params = M.init_params(model_cfg, rng, boxed=boxed)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                    skipped_updates=jnp.zeros((), jnp.int32))


def state_shardings(model_cfg: M.ModelConfig, optimizer, mesh, rules=sharding.DEFAULT_RULES):
  """NamedShardings of the TrainState from the parameters' logical axes (optimizer moments follow them)."""
  abstract = jax.eval_shape(lambda: _init_state(model_cfg, optimizer, jax.random.PRNGKey(0), boxed=True))
  return sharding.logical_shardings(nn.get_partition_spec(abstract), mesh, rules)


def create_train_state(model_cfg: M.ModelConfig, optimizer, rng, mesh=None, rules=sharding.DEFAULT_RULES):
  """Fresh state; with a mesh it is created directly sharded (never materialised on one device)."""
  if mesh is None:  # jitted: op-by-op initialisation is slow
    return jax.jit(lambda key: _init_state(model_cfg, optimizer, key, boxed=False))(rng)
  state, _ = sharding.create_sharded(lambda: _init_state(model_cfg, optimizer, rng, boxed=True), mesh, rules)
  return state


# ---------------------------------------------------------------------------------------------- RL step
def _valid(batch: RLBatch):
  if batch.valid_B is None:
    return jnp.ones(batch.rewards_B.shape, bool)
  return batch.valid_B > 0


def _masked_percentile(x_B, keep_B, q):
  return jnp.nanpercentile(jnp.where(keep_B, x_B, jnp.nan), q)


def _sample_stats(logp_BxT, batch: RLBatch, mask_BxT, valid_B, sq_norms_B, lc: LearnerConfig) -> dict:
  """IS weights and advantages (stop-gradient) of the given rows (the ESS is formed over the whole batch)."""
  logp_BxT = jax.lax.stop_gradient(logp_BxT)
  logw_B = vcpo.seq_log_weights(logp_BxT, batch.sampler_logp_BxT, mask_BxT)
  wt_B = vcpo.truncated_weights(logw_B, lc.tis_threshold)
  lengths_B = jnp.sum(mask_BxT, axis=-1)
  rewards_B = batch.rewards_B.astype(jnp.float32)
  if lc.advantage == "opob":  # called directly (not via the registry) to also get the baseline for logging
    o = lc.opob_options()
    adv_B, baseline_B = vcpo.opob_advantages(
        rewards_B, batch.group_B, sq_norms_B, logw_B, wt_B, lengths_B, scope=o.scope,
        is_weight=o.is_weight, normalize_by_length=o.normalize_by_length, aggregation=o.aggregation,
        norm_by_std=o.norm_by_std, winsor_quantiles=tuple(o.winsor_quantiles), valid_B=valid_B)
    return {"logw_B": logw_B, "wt_B": wt_B, "adv_B": adv_B, "baseline_B": baseline_B}
  inputs = losses.AdvantageInputs(rewards_B=rewards_B, group_B=batch.group_B, logw_B=logw_B, wt_B=wt_B,
                                  lengths_B=lengths_B, valid_B=valid_B)
  adv_B = losses.get_advantage_fn(lc.advantage)(inputs, **lc.estimator_options())
  return {"logw_B": logw_B, "wt_B": wt_B, "adv_B": adv_B}


def _policy_loss(logp_BxT, batch: RLBatch, mask_BxT, adv_B, lc: LearnerConfig):
  """Scalar aggregated loss of the registered policy loss (+ optional k3 KL) and its aux metrics."""
  loss_fn = losses.get_policy_loss(lc.policy_loss)
  loss_BxT, loss_mask_BxT, aux = loss_fn(
      logp_BxT, batch.sampler_logp_BxT.astype(jnp.float32), mask_BxT, jax.lax.stop_gradient(adv_B),
      prox_logp_BxT=batch.prox_logp_BxT, ref_logp_BxT=batch.ref_logp_BxT, kl_beta=lc.kl_beta,
      **lc.loss_options())
  return losses.aggregate(loss_BxT, loss_mask_BxT, lc.aggregation), aux


def _seq_coefficients(logp_BxT, batch, mask_BxT, adv_B, lc: LearnerConfig):
  """c_i = d loss / d(sum_t m_t log pi_t), read off the registered loss itself (constant over t for
  SEQ_SCALAR_LOSSES), so the book-keeping gradient is that loss's gradient."""
  (loss, aux), dlogp_BxT = jax.value_and_grad(
      lambda lp: _policy_loss(lp, batch, mask_BxT, adv_B, lc), has_aux=True)(logp_BxT)
  c_B = jnp.sum(dlogp_BxT * mask_BxT, axis=-1) / jnp.maximum(jnp.sum(mask_BxT, axis=-1), 1.0)
  return c_B, loss, aux


def _loss_and_grads(params, batch: RLBatch, mask_BxT, valid_B, model_cfg, lc: LearnerConfig):
  """(loss, grads, stats, ent_BxT, sq_norms_B or None, loss aux) along the path the config selects."""
  tokens = batch.tokens_BxT.astype(jnp.int32)
  if lc.uses_bookkeeping:
    def coef_fn(sq_B, logp_BxT, ent_BxT):
      del ent_BxT
      stats = _sample_stats(logp_BxT, batch, mask_BxT, valid_B, sq_B, lc)
      c_B, loss, aux = _seq_coefficients(logp_BxT, batch, mask_BxT, stats["adv_B"], lc)
      return c_B, (stats, loss, aux)
    grads, sq_B, gaux = grad_norms.per_sequence_sq_norms_and_grad(
        params, model_cfg, tokens, mask_BxT, coef_fn, mode=lc.grad_norm_mode)
    stats, loss, aux = gaux["extra"]
    return loss, grads, stats, gaux["ent_BxT"], sq_B, aux

  sq_B = None
  if lc.needs_grad_norms:
    sq_B, _ = grad_norms.per_sequence_sq_norms(params, model_cfg, tokens, mask_BxT, mode=lc.grad_norm_mode)

  def loss_fn(p):
    logp_BxT, ent_BxT = M.token_logprobs_and_entropy(p, model_cfg, tokens, mask_BxT)
    stats = _sample_stats(logp_BxT, batch, mask_BxT, valid_B, sq_B, lc)
    loss, aux = _policy_loss(logp_BxT, batch, mask_BxT, stats["adv_B"], lc)
    return loss, (stats, jax.lax.stop_gradient(ent_BxT), aux)

  (loss, (stats, ent_BxT, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, grads, stats, ent_BxT, sq_B, aux


def _aggregation_denominator(mask_BxT, mode: str):
  """What losses.aggregate divides by over these rows: tokens ('token-mean') or non-empty rows (else)."""
  len_B = jnp.sum(mask_BxT, axis=-1)
  if mode == "token-mean":
    return jnp.maximum(jnp.sum(len_B), 1.0)
  return jnp.maximum(jnp.sum((len_B > 0).astype(jnp.float32)), 1.0)


def _chunk_order(b: int, micro: int, row_shards: int):
  """Row permutation into [chunks, micro]: each chunk takes micro/row_shards contiguous rows of every
  data shard, so every device works on every chunk (and contiguous groups stay whole)."""
  idx = np.arange(b).reshape(row_shards, b // micro, micro // row_shards)
  return idx.transpose(1, 0, 2).reshape(b // micro, micro)


def _chunked_loss_and_grads(params, batch: RLBatch, mask_BxT, valid_B, model_cfg, lc: LearnerConfig,
                            row_shards: int):
  """Same results as _loss_and_grads on the whole batch, computed by a scan over chunks of whole groups."""
  b, micro = mask_BxT.shape[0], lc.micro_batch_size
  order = _chunk_order(b, micro, row_shards)
  chunks = jax.tree.map(lambda x: x[order], (batch, mask_BxT, valid_B))
  total_den = _aggregation_denominator(mask_BxT, lc.aggregation)

  def body(acc, chunk):
    cb, cm, cv = chunk
    loss, grads, stats, ent, sq, aux = _loss_and_grads(params, cb, cm, cv, model_cfg, lc)
    scale = _aggregation_denominator(cm, lc.aggregation) / total_den  # chunk mean -> share of batch mean
    acc = jax.tree.map(lambda a, g: a + scale * g.astype(a.dtype), acc, grads)
    return acc, (loss * scale, stats, ent, sq, aux)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grads, (loss_n, stats, ent, sq, aux) = jax.lax.scan(body, zeros, chunks)
  inverse = np.argsort(order.reshape(-1))
  rows = lambda x: x.reshape((b,) + x.shape[2:])[inverse]
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return (jnp.sum(loss_n), grads, jax.tree.map(rows, stats), rows(ent), None if sq is None else rows(sq),
          jax.tree.map(jnp.mean, aux))


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _apply_update(state: TrainState, grads, loss, optimizer, ess_ratio, ess, inputs_ok=True):
  """Optimizer step unless the inputs, the loss or a gradient are non-finite; then state is kept and counted."""
  updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params, ess_ratio=ess_ratio, ess=ess)
  new_params = optax.apply_updates(state.params, updates)
  ok = jnp.isfinite(loss) & _all_finite(grads) & inputs_ok
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  new_state = state.replace(step=state.step + 1, params=keep(new_params, state.params),
                            opt_state=keep(new_opt_state, state.opt_state),
                            skipped_updates=state.skipped_updates + (~ok).astype(jnp.int32))
  lr_scale = optimizer_lib.last_ess_scale(new_opt_state)
  return new_state, ok, jnp.float32(1.0) if lr_scale is None else lr_scale


def _rl_metrics(loss, grads, stats, ent_BxT, sq_B, aux, batch, mask_BxT, valid_B, lc, lr_scale, ok, state):
  nan = jnp.float32(jnp.nan)
  logw_B, lag_B = stats["logw_B"], batch.lag_B.astype(jnp.float32)
  n_valid = jnp.maximum(jnp.sum(valid_B), 1)
  tau = lc.tis_threshold
  truncated_B = (logw_B > jnp.log(tau)) if tau is not None else jnp.zeros_like(valid_B)
  metrics = {
      "loss": loss, "grad_norm": optax.tree.norm(grads), "ess": stats["ess"],
      "ess_ratio": stats["ess_ratio"], "lr_scale": lr_scale,
      "is/logw_max": jnp.max(jnp.where(valid_B, logw_B, -jnp.inf)),
      "is/logw_p99": _masked_percentile(logw_B, valid_B, 99.0),
      "is/frac_truncated": jnp.sum(truncated_B & valid_B) / n_valid,
      "is/weight_mean": jnp.sum(jnp.where(valid_B, stats["wt_B"], 0.0)) / n_valid,
      "entropy": jnp.sum(ent_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0),
      "adv/mean": jnp.sum(jnp.where(valid_B, stats["adv_B"], 0.0)) / n_valid,
      "adv/abs_mean": jnp.sum(jnp.where(valid_B, jnp.abs(stats["adv_B"]), 0.0)) / n_valid,
      "lag/mean": jnp.sum(jnp.where(valid_B, lag_B, 0.0)) / n_valid,
      "lag/max": jnp.max(jnp.where(valid_B, lag_B, -jnp.inf)),
      "skipped_updates": state.skipped_updates, "update_applied": ok.astype(jnp.float32),
      "hist/logw_B": jnp.where(valid_B, logw_B, nan), "hist/lag_B": jnp.where(valid_B, lag_B, nan),
  }
  if "baseline_B" in stats:
    metrics["baseline"] = jnp.sum(jnp.where(valid_B, stats["baseline_B"], 0.0)) / n_valid
  if sq_B is not None:
    norm_B = jnp.sqrt(sq_B)
    for q in (10, 50, 90):
      metrics[f"seq_grad_norm/p{q}"] = _masked_percentile(norm_B, valid_B, float(q))
    metrics["seq_grad_norm/max"] = jnp.max(jnp.where(valid_B, norm_B, -jnp.inf))
    metrics["hist/seq_grad_norm_B"] = jnp.where(valid_B, norm_B, nan)
  metrics.update({f"loss/{k}": v for k, v in aux.items()})
  return metrics


def rl_step(state: TrainState, batch: RLBatch, *, model_cfg: M.ModelConfig, learner_cfg: LearnerConfig,
            optimizer: optax.GradientTransformationExtraArgs, row_shards: int = 1):
  """One RL update (pure): recompute log-probs, IS weights, ESS, advantages, weighted gradient, optimizer.

  row_shards: how many data shards the rows are split over (only orders micro-batch chunks).
  """
  lc = learner_cfg
  valid_B = _valid(batch)
  mask_BxT = batch.mask_BxT.astype(jnp.float32) * valid_B[:, None].astype(jnp.float32)
  if lc.micro_batch_size and lc.micro_batch_size < mask_BxT.shape[0]:
    loss, grads, stats, ent_BxT, sq_B, aux = _chunked_loss_and_grads(
        state.params, batch, mask_BxT, valid_B, model_cfg, lc, row_shards)
  else:
    loss, grads, stats, ent_BxT, sq_B, aux = _loss_and_grads(state.params, batch, mask_BxT, valid_B, model_cfg,
                                                             lc)
  stats["ess"] = vcpo.ess(stats["logw_B"], valid_B)
  stats["ess_ratio"] = vcpo.ess_ratio(stats["logw_B"], valid_B)
  # A NaN reward can be absorbed silently (e.g. a NaN group std reads as "std 0" -> advantage 0), so
  # corrupt inputs are checked directly rather than only through the gradient.
  inputs_ok = (jnp.all(jnp.isfinite(batch.rewards_B) | ~valid_B)
               & jnp.all(jnp.isfinite(batch.sampler_logp_BxT) | (mask_BxT == 0)))
  new_state, ok, lr_scale = _apply_update(state, grads, loss, optimizer, stats["ess_ratio"], stats["ess"],
                                          inputs_ok)
  metrics = _rl_metrics(loss, grads, stats, ent_BxT, sq_B, aux, batch, mask_BxT, valid_B, lc, lr_scale, ok,
                        new_state)
  return new_state, metrics


# ---------------------------------------------------------------------------------------------- SFT step
def sft_step(state: TrainState, tokens_BxT, mask_BxT, *, model_cfg: M.ModelConfig,
             optimizer: optax.GradientTransformationExtraArgs):
  """Masked next-token NLL (token mean) for the warm start; ESS arguments are neutral (ratio 1)."""
  mask_BxT = mask_BxT.astype(jnp.float32)

  def loss_fn(p):
    logp_BxT = M.token_logprobs(p, model_cfg, tokens_BxT.astype(jnp.int32), mask_BxT)
    return -jnp.sum(logp_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  ess = jnp.float32(tokens_BxT.shape[0])
  new_state, ok, _ = _apply_update(state, grads, loss, optimizer, jnp.float32(1.0), ess)
  return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads),
                     "skipped_updates": new_state.skipped_updates, "update_applied": ok.astype(jnp.float32)}


# ---------------------------------------------------------------------------------------------- jitting
def _batch_rows(mesh) -> int:
  return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def _jit_step(fn: Callable, model_cfg, optimizer, mesh, rules, check: Callable, num_batch_args: int = 1):
  """jit once; with a mesh: explicit shardings (state from logical axes, batch rows over data x fsdp)."""
  if mesh is None:
    jitted = jax.jit(fn, donate_argnums=0)

    def call(state, *batch):
      check(*batch)
      return jitted(state, *batch)
    return call
  state_sh = state_shardings(model_cfg, optimizer, mesh, rules)
  rows = sharding.batch_sharding(mesh, ndim=1)  # a prefix spec: only the leading (row) dim is split
  jitted = jax.jit(fn, in_shardings=(state_sh,) + (rows,) * num_batch_args, out_shardings=(state_sh, sharding.replicated(mesh)),
                   donate_argnums=0)
  n = _batch_rows(mesh)

  def call(state, *batch):
    check(*batch)
    b = jax.tree.leaves(batch)[0].shape[0]
    if b % n:
      raise ValueError(f"batch rows B={b} must be divisible by the mesh's data x fsdp = {n}")
    with jax.set_mesh(mesh), nn.logical_axis_rules(list(rules)):
      return jitted(state, *batch)
  return call


def make_rl_step(model_cfg: M.ModelConfig, learner_cfg: LearnerConfig, optimizer, mesh=None,
                 rules=sharding.DEFAULT_RULES):
  """`step(state, batch) -> (state, metrics)`, jitted once (state donated; shardings when a mesh is given)."""
  shards = _batch_rows(mesh)
  fn = lambda state, batch: rl_step(state, batch, model_cfg=model_cfg, learner_cfg=learner_cfg,
                                    optimizer=optimizer, row_shards=shards)

  def check(batch):
    check_batch(batch)
    check_chunks(batch, learner_cfg.micro_batch_size, shards)
  return _jit_step(fn, model_cfg, optimizer, mesh, rules, check)


def make_sft_step(model_cfg: M.ModelConfig, optimizer, mesh=None, rules=sharding.DEFAULT_RULES):
  """`step(state, tokens_BxT, mask_BxT) -> (state, metrics)`, jitted once."""
  def check(tokens, mask):
    if tokens.ndim != 2 or tuple(mask.shape) != tuple(tokens.shape):
      raise ValueError(f"sft tokens_BxT and mask_BxT must be equal 2-D shapes, got {tokens.shape}, {mask.shape}")
  fn = lambda state, tokens, mask: sft_step(state, tokens, mask, model_cfg=model_cfg, optimizer=optimizer)
  return _jit_step(fn, model_cfg, optimizer, mesh, rules, check, num_batch_args=2)
