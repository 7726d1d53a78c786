"""TrainState (params, optimizer state, optional frozen reference), its creation and shardings, the guarded
optimizer update, the SFT step and the jit wrapper both steps share."""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from vcpo_jax.learner import optimizer as optimizer_lib
from vcpo_jax.model import config as model_config
from vcpo_jax.model import lora
from vcpo_jax.model import remat as remat_lib
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import sharding


@flax.struct.dataclass
class TrainState:
  step: jax.Array              # int32, learner steps taken (skipped ones included)
  params: Any                  # what trains: the model's params, or with model.lora the adapter alone
  opt_state: Any               # the optimizer's state of `params` (so of the adapter alone with LoRA)
  skipped_updates: jax.Array   # int32, steps whose loss or gradient was not finite (update not applied)
  ref_params: Any = None       # frozen reference policy for the KL term (None without KL or with LoRA); checkpointed
  base: Any = None             # with model.lora: the frozen base params (also the KL reference); else None


def _init_state(model_cfg: model_config.ModelConfig, optimizer, rng, boxed: bool, with_ref: bool = False) -> TrainState:
  params = M.init_params(model_cfg, rng, boxed=boxed)
  base = None
  if model_cfg.lora.rank:  # the adapter trains; the base is frozen and is the reference (no copy)
    base, params = params, lora.init_adapter(jax.random.fold_in(rng, 1), model_cfg, boxed=boxed)
    with_ref = False
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                    skipped_updates=jnp.zeros((), jnp.int32), ref_params=params if with_ref else None, base=base)


def model_args(trainable, base):
  """(params, adapter) of the model for the trainable tree: (trainable, None), or with LoRA (base, trainable)."""
  return (trainable, None) if base is None else (base, trainable)


def base_params(state: TrainState):
  """The model's own params: the frozen base with LoRA, else the trained params."""
  return state.params if state.base is None else state.base


def policy_params(state: TrainState, model_cfg: model_config.ModelConfig):
  """Full weights of the current policy: with LoRA the base with the adapter merged in (a full-weight copy,
  for what publishes or evaluates full weights), else the params themselves."""
  if state.base is None:
    return state.params
  return _merge_fn(model_cfg)(state.base, state.params)


@functools.lru_cache(maxsize=None)
def _merge_fn(model_cfg: model_config.ModelConfig):
  return jax.jit(lambda base, adapter: lora.merge(base, adapter, model_cfg))


def state_shardings(model_cfg: model_config.ModelConfig, optimizer, mesh, rules=sharding.DEFAULT_RULES, with_ref=False):
  """NamedShardings of the TrainState from the parameters' logical axes (optimizer moments follow them)."""
  abstract = jax.eval_shape(lambda: _init_state(model_cfg, optimizer, jax.random.PRNGKey(0), boxed=True,
                                                with_ref=with_ref))
  return sharding.logical_shardings(nn.get_partition_spec(abstract), mesh, rules)


def create_train_state(model_cfg: model_config.ModelConfig, optimizer, rng, mesh=None, rules=sharding.DEFAULT_RULES):
  """Fresh state; with a mesh it is created directly sharded (never materialised on one device)."""
  if mesh is None:  # jitted: op-by-op initialisation is slow
    return jax.jit(lambda key: _init_state(model_cfg, optimizer, key, boxed=False))(rng)
  state, _ = sharding.create_sharded(lambda: _init_state(model_cfg, optimizer, rng, boxed=True), mesh, rules)
  return state


def with_reference(state: TrainState) -> TrainState:
  """The state with ref_params = a copy of the current params (the KL reference; frozen from here on).
  A copy, not the same buffers: the step donates the state, and donation must not alias two leaves.
  With LoRA the state as it is: the reference is the frozen base with the adapter off."""
  if state.base is not None:
    return state
  return state.replace(ref_params=jax.tree.map(jnp.copy, state.params))


def with_params(state: TrainState, params) -> TrainState:
  """The state with `params` swapped in (e.g. the warm start's), the optimizer's float32 master copy too.
  With LoRA `params` are the model's: they become the frozen base (the adapter is kept)."""
  if state.base is not None:
    return state.replace(base=params)
  return state.replace(params=params, opt_state=optimizer_lib.reset_master(state.opt_state, params))


def all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def apply_update(state: TrainState, grads, loss, optimizer, ess_ratio, ess, inputs_ok=True):
  """Optimizer step unless the inputs, the loss or a gradient are non-finite; then state is kept and counted."""
  updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params, ess_ratio=ess_ratio, ess=ess)
  new_params = optax.apply_updates(state.params, updates)
  ok = jnp.isfinite(loss) & all_finite(grads) & inputs_ok
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  new_state = state.replace(step=state.step + 1, params=keep(new_params, state.params),
                            opt_state=keep(new_opt_state, state.opt_state),
                            skipped_updates=state.skipped_updates + (~ok).astype(jnp.int32))
  lr_scale = optimizer_lib.last_ess_scale(new_opt_state)
  return new_state, ok, jnp.float32(1.0) if lr_scale is None else lr_scale


# ---------------------------------------------------------------------------------------------- SFT step
def sft_step(state: TrainState, tokens_BxT, mask_BxT, *, model_cfg: model_config.ModelConfig,
             optimizer: optax.GradientTransformationExtraArgs):
  """Masked next-token NLL (token mean) for the warm start; ESS arguments are neutral (ratio 1)."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  model_cfg = remat_lib.resolve(model_cfg, -(-tokens_BxT.shape[0] // remat_lib.row_shards()), tokens_BxT.shape[1],
                                remat_lib.state_bytes_per_device(state))

  def loss_fn(p):
    params, adapter = model_args(p, state.base)
    logp_BxT = M.token_logprobs(params, model_cfg, tokens_BxT.astype(jnp.int32), mask_BxT, adapter=adapter)
    return -jnp.sum(logp_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  ess = jnp.float32(tokens_BxT.shape[0])
  new_state, ok, _ = apply_update(state, grads, loss, optimizer, jnp.float32(1.0), ess)
  return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads),
                     "skipped_updates": new_state.skipped_updates, "update_applied": ok.astype(jnp.float32)}


# ---------------------------------------------------------------------------------------------- jitting
def batch_rows(mesh) -> int:
  return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def jit_step(fn: Callable, model_cfg, optimizer, mesh, rules, check: Callable, num_batch_args: int = 1,
             with_ref: bool = False):
  """jit once; with a mesh: explicit shardings (state from logical axes, batch rows over data x fsdp), and
  `call.lower(state, *batch)` lowers the same program (abstract inputs welcome) under the mesh."""
  if mesh is None:
    jitted = jax.jit(fn, donate_argnums=0)

    def call(state, *batch):
      check(*batch)
      return jitted(state, *batch)
    return call
  state_sh = state_shardings(model_cfg, optimizer, mesh, rules, with_ref=with_ref)
  rows = sharding.batch_sharding(mesh, ndim=1)  # a prefix spec: only the leading (row) dim is split
  jitted = jax.jit(fn, in_shardings=(state_sh,) + (rows,) * num_batch_args,
                   out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=0)
  n = batch_rows(mesh)

  def call(state, *batch):
    check(*batch)
    b = jax.tree.leaves(batch)[0].shape[0]
    if b % n:
      raise ValueError(f"batch rows B={b} must be divisible by the mesh's data x fsdp = {n}")
    with jax.set_mesh(mesh), nn.logical_axis_rules(list(rules)):
      return jitted(state, *batch)

  def lower(state, *batch):  # the same program on abstract inputs, for ahead-of-time compiles (benchmarks/aot)
    with jax.set_mesh(mesh), nn.logical_axis_rules(list(rules)):
      return jitted.lower(state, *batch)
  call.lower = lower
  return call


def make_sft_step(model_cfg: model_config.ModelConfig, optimizer, mesh=None, rules=sharding.DEFAULT_RULES):
  """`step(state, tokens_BxT, mask_BxT) -> (state, metrics)`, jitted once."""
  def check(tokens, mask):
    if tokens.ndim != 2 or tuple(mask.shape) != tuple(tokens.shape):
      raise ValueError(f"sft tokens_BxT and mask_BxT must be equal 2-D shapes, got {tokens.shape}, {mask.shape}")
  fn = lambda state, tokens, mask: sft_step(state, tokens, mask, model_cfg=model_cfg, optimizer=optimizer)
  return jit_step(fn, model_cfg, optimizer, mesh, rules, check, num_batch_args=2)
