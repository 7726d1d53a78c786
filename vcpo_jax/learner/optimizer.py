"""The optax chain (clip -> Adam or SGD momentum -> decoupled decay -> lr -> ESS scaling) and `scale_by_ess`."""
import math
from typing import Any, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

RULES = ('sqrt', 'linear')
OPTIMIZERS = ('adamw', 'sgd')
SCHEDULES = ('constant', 'warmup_constant', 'cosine', 'linear')


class ScaleByESSState(NamedTuple):
  base_ess_ratio: jax.Array  # float32; NaN until the first valid ratio arrives when base is 'auto'
  last_scale: jax.Array      # float32 factor applied by the last update (1 before any update)
  count: jax.Array           # int32 number of updates seen


class ArgumentError(ValueError):
  """A bad argument, with its name and value, so a config that passes its fields through names its own."""

  def __init__(self, name: str, value: Any, requirement: str):
    super().__init__(f'{name} {requirement}, got {name}={value!r}')
    self.name, self.value, self.requirement = name, value, requirement


def _number(name: str, value, ok, requirement: str) -> float:
  """value as a float if it is a finite number (a numeric string too, never a bool) that `ok` accepts."""
  try:
    number = float(value) if not isinstance(value, bool) else float('nan')
  except (TypeError, ValueError):
    number = float('nan')
  if not (math.isfinite(number) and ok(number)):
    raise ArgumentError(name, value, requirement)
  return number


def _check_positive(name: str, value) -> float:
  return _number(name, value, lambda v: v > 0, 'must be a positive finite number')


def check_base_ess_ratio(value) -> Union[float, str]:
  """base_ess_ratio: 'auto', or a positive finite number (also as a numeric string, as a command line gives)."""
  if value == 'auto':
    return 'auto'
  return _number('base_ess_ratio', value, lambda v: v > 0, "must be a positive number or 'auto'")


def ess_step_scale(ess_ratio, base_ess_ratio, *, rule: str = 'sqrt', trigger: float = 0.0, ess=None,
                   min_ess_floor: float = 0.0, min_ess_factor: float = 0.5) -> jax.Array:
  """Multiplier on the update: rule(min(1, rho / base)), with optional trigger and brake.

  trigger > 0: rho / base >= trigger gives the full step. min_ess_floor > 0: the step is multiplied by
  min_ess_factor when ESS <= min_ess_floor or ESS is NaN. A non-finite ratio or base (e.g. NaN ESS, or 'auto'
  still unset) gives 0: the step is skipped, never full.
  """
  ratio = jnp.asarray(ess_ratio, jnp.float32)
  base = jnp.asarray(base_ess_ratio, jnp.float32)
  ok = jnp.isfinite(ratio) & jnp.isfinite(base) & (base > 0)
  rel = jnp.clip(jnp.where(ok, ratio / jnp.where(ok, base, 1.0), 0.0), 0.0, 1.0)
  scale = jnp.sqrt(rel) if rule == 'sqrt' else rel
  if trigger > 0:
    scale = jnp.where(rel < trigger, scale, 1.0)
  if min_ess_floor > 0:
    ess = jnp.asarray(ess, jnp.float32)
    braked = jnp.isnan(ess) | (ess <= min_ess_floor)
    scale = jnp.where(braked, scale * min_ess_factor, scale)
  return jnp.where(ok, scale, 0.0).astype(jnp.float32)


def scale_by_ess(base_ess_ratio: Union[float, str] = 1.0, rule: str = 'sqrt', trigger: float = 0.0,
                 min_ess_floor: float = 0.0, min_ess_factor: float = 0.5) -> optax.GradientTransformationExtraArgs:
  """Scales updates by sqrt(s) ('sqrt') or s ('linear'), s = min(1, ess_ratio / base_ess_ratio).

  update(updates, state, params=None, *, ess_ratio, ess=None, **extra). Place it after
  scale_by_learning_rate so the whole step (decoupled weight decay included) is scaled, as in VCPO.
  base_ess_ratio='auto' takes the first finite positive ess_ratio as the base. trigger > 0: full step unless
  ratio/base < trigger (0: off). min_ess_floor > 0: multiply by min_ess_factor when ESS <= min_ess_floor (NaN
  counts; 0: off). A non-finite ess_ratio yields scale 0, i.e. a skipped step (Adam's moments still see the
  gradient). The job's config section algo.ess holds exactly these arguments (plus its switch, `enabled`); a
  bad one raises ArgumentError naming it.
  """
  base_ess_ratio = check_base_ess_ratio(base_ess_ratio)
  auto = base_ess_ratio == 'auto'
  if rule not in RULES:
    raise ArgumentError('rule', rule, f'must be one of {RULES}')
  trigger = _number('trigger', trigger, lambda v: v >= 0, 'must be a number >= 0 (0: off)')
  min_ess_floor = _number('min_ess_floor', min_ess_floor, lambda v: v >= 0, 'must be a number >= 0 (0: off)')
  min_ess_factor = _number('min_ess_factor', min_ess_factor, lambda v: 0 <= v <= 1, 'must be a number in [0, 1]')

  def init_fn(params):
    del params
    base = jnp.float32(jnp.nan) if auto else jnp.float32(base_ess_ratio)
    return ScaleByESSState(base_ess_ratio=jnp.asarray(base, jnp.float32), last_scale=jnp.ones((), jnp.float32),
                           count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, *, ess_ratio=None, ess=None, **extra):
    del params, extra
    if ess_ratio is None:
      raise ValueError('scale_by_ess.update needs the keyword argument ess_ratio (got ess_ratio=None)')
    if min_ess_floor > 0 and ess is None:
      raise ValueError('scale_by_ess with min_ess_floor > 0 needs the keyword argument ess (got ess=None)')
    ratio = jnp.asarray(ess_ratio, jnp.float32)
    base = state.base_ess_ratio
    if auto:
      usable = jnp.isnan(base) & jnp.isfinite(ratio) & (ratio > 0)
      base = jnp.where(usable, ratio, base)
    scale = ess_step_scale(ratio, base, rule=rule, trigger=trigger, ess=ess, min_ess_floor=min_ess_floor,
                           min_ess_factor=min_ess_factor)
    updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
    return updates, ScaleByESSState(base_ess_ratio=base, last_scale=scale,
                                    count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _count(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ArgumentError(name, value, 'must be an int >= 0')
  return value


def learning_rate_schedule(name: str = 'constant', *, learning_rate: float, warmup_steps: int = 0,
                           decay_steps: int = 0, final_lr_fraction: float = 0.0) -> optax.Schedule:
  """'constant', 'warmup_constant' (linear 0 -> learning_rate over warmup_steps), 'cosine' or 'linear'
  (warmup, then cosine or linear decay to final_lr_fraction * learning_rate at decay_steps, constant after).
  The job's optim.schedule holds exactly these arguments but learning_rate (optim.learning_rate); a bad one
  raises ArgumentError naming it."""
  if name not in SCHEDULES:
    raise ArgumentError('name', name, f'must be one of {SCHEDULES}')
  warmup_steps, decay_steps = _count('warmup_steps', warmup_steps), _count('decay_steps', decay_steps)
  final_lr_fraction = _number('final_lr_fraction', final_lr_fraction, lambda v: v >= 0, 'must be a number >= 0')
  if name == 'constant':
    return optax.constant_schedule(learning_rate)
  if name == 'warmup_constant':
    if warmup_steps == 0:
      return optax.constant_schedule(learning_rate)
    return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps),
                                 optax.constant_schedule(learning_rate)], [warmup_steps])
  if decay_steps <= warmup_steps:
    raise ArgumentError('decay_steps', decay_steps, f'must be > warmup_steps={warmup_steps} for {name}')
  end_value = learning_rate * final_lr_fraction
  if name == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, decay_steps, end_value)
  decay = optax.linear_schedule(learning_rate, end_value, decay_steps - warmup_steps)
  if warmup_steps == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), decay], [warmup_steps])


class Float32MasterState(NamedTuple):
  master: Any   # float32 copy of the params when some are lower precision (bfloat16); None otherwise
  inner: Any    # the wrapped transform's state (float32 moments when master is set)


def _low_precision(params) -> bool:
  return any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4
             for x in jax.tree.leaves(params))


def _exact_float32(x, dtype):
  """x (float32 or lower) as float32 holding exactly its value rounded to `dtype`. Under jit XLA may drop a
  bf16 -> float32 round trip (excess precision) and hand back the unrounded float32 a bf16 value was computed
  from: a master copy made that way differs from the params by up to half a bf16 ulp, and the first update
  then moves every param by that much whatever the learning rate."""
  x = jnp.asarray(x, jnp.float32)
  if jnp.dtype(dtype).itemsize >= 4 or not jnp.issubdtype(dtype, jnp.floating):
    return x
  fi = jnp.finfo(dtype)
  return jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def float32_master(inner: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
  """Runs `inner` in float32 on a float32 master copy of low-precision params (a no-op for float32 ones).

  With bfloat16 params an lr-1e-6 Adam step is far below half an ulp and rounds away: the moments and the
  accumulated params live in float32 here, and the returned updates move each param to its master's
  rounding (apply_updates adds them in float32, so the result is exactly that rounding).
  """
  def init_fn(params):
    if not _low_precision(params):
      return Float32MasterState(master=None, inner=inner.init(params))
    master = jax.tree.map(lambda p: _exact_float32(p, p.dtype), params)
    return Float32MasterState(master=master, inner=inner.init(master))

  def update_fn(updates, state, params=None, **extra):
    if state.master is None:
      updates, inner_state = inner.update(updates, state.inner, params, **extra)
      return updates, Float32MasterState(master=None, inner=inner_state)
    if params is None:
      raise ValueError('float32_master.update needs params (the low-precision params being trained)')
    grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), updates)
    steps, inner_state = inner.update(grads, state.inner, state.master, **extra)
    master = optax.apply_updates(state.master, steps)
    updates = jax.tree.map(lambda m, p: _exact_float32(m, p.dtype) - _exact_float32(p, p.dtype), master, params)
    return updates, Float32MasterState(master=master, inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def reset_master(opt_state, params):
  """opt_state with every float32 master copy replaced by `params` in float32 (after params are swapped in,
  e.g. the warm-start weights loaded into a freshly initialised state)."""
  def reset(s):
    if isinstance(s, Float32MasterState) and s.master is not None:
      return s._replace(master=jax.tree.map(lambda p, m: _exact_float32(p, p.dtype).astype(m.dtype), params,
                                            s.master))
    return s
  return jax.tree.map(reset, opt_state, is_leaf=lambda x: isinstance(x, Float32MasterState))


def build_optimizer(*, learning_rate: Union[float, optax.Schedule], b1: float = 0.9, b2: float = 0.999,
                    eps: float = 1e-8, weight_decay: float = 0.1, max_grad_norm: Optional[float] = 1.0,
                    weight_decay_mask: Any = None, ess_scaling: bool = True,
                    ess: Optional[Mapping[str, Any]] = None, name: str = 'adamw',
                    momentum: float = 0.9) -> optax.GradientTransformationExtraArgs:
  """clip_by_global_norm -> direction -> add_decayed_weights -> scale_by_learning_rate -> scale_by_ess,
  run in float32 on a master copy when the params are lower precision (float32_master).

  name 'adamw': the direction is scale_by_adam(b1, b2, eps). name 'sgd': heavy-ball momentum
  (m <- momentum * m + g, float32 state) and no decoupled decay (weight_decay is ignored: AdamW's lr x decay
  at an SGD learning rate would shrink the weights by far more per step); no per-coordinate normalisation, so a
  gradient scaled by c gives an update scaled by c while the clip does not bind.
  Call update(grads, state, params, ess_ratio=rho, ess=ess). ess: scale_by_ess's keyword arguments (None: its
  defaults). With ess_scaling=False the ESS arguments are accepted and ignored. max_grad_norm None or 0
  disables clipping.
  """
  if not (callable(learning_rate) or float(learning_rate) >= 0):
    raise ArgumentError('learning_rate', learning_rate, 'must be >= 0 or a schedule')
  if weight_decay < 0:
    raise ArgumentError('weight_decay', weight_decay, 'must be >= 0')
  if name not in OPTIMIZERS:
    raise ArgumentError('name', name, f'must be one of {OPTIMIZERS}')
  momentum = _number('momentum', momentum, lambda v: 0 <= v < 1, 'must be a number in [0, 1)')
  parts = []
  if max_grad_norm:
    parts.append(optax.clip_by_global_norm(_check_positive('max_grad_norm', max_grad_norm)))
  if name == 'sgd':
    parts.append(optax.trace(decay=momentum, nesterov=False, accumulator_dtype=jnp.float32))
  else:
    parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if weight_decay:
      parts.append(optax.add_decayed_weights(weight_decay, mask=weight_decay_mask))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  if ess_scaling:
    parts.append(scale_by_ess(**(ess or {})))
  return float32_master(optax.chain(*parts))


def last_ess_scale(opt_state) -> Optional[jax.Array]:
  """The last ESS scale recorded in a chain's state (None if the chain has no scale_by_ess)."""
  for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleByESSState)):
    if isinstance(s, ScaleByESSState):
      return s.last_scale
  return None
