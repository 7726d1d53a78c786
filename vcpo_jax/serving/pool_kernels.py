"""Jitted kernels of continuous batching: a pool of B decode slots, each row at its own cache index.

Rows join (their prompts prefilled into free slots) and leave between decode chunks. A row's cache holds
its prompt at slots [0, L) and its generated tokens after it: slot index = RoPE position, no padding.
Shape letters: B pool slots, J joining rows, P prompt slots, S cache slots per row, C steps per chunk,
K stop ids per row, V vocab. With LoRA the kernels take a stack of N adapters (`adapter`, model/lora.py)
and each row its slot in it (adapter_B, -1: the base); without (adapter None) they are the base model's.
The cache is an opaque pytree from model.init_cache: its batch and slot axes
are found from abstract shapes (cache_axes), so a layer-stacked cache works unchanged.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from vcpo_jax.model import config as model_config
from vcpo_jax.model import decode_kernels as kernels
from vcpo_jax.model import sampling_fields
from vcpo_jax.model import transformer as model_lib


class PoolState(NamedTuple):
  cache: tuple
  rows: sampling_fields.RowArrays
  index_B: jax.Array  # cache slot (= position) where last_token_B is written by the next step
  last_token_B: jax.Array
  num_gen_B: jax.Array  # tokens generated since the row joined
  done_B: jax.Array  # True on free slots too
  stopped_B: jax.Array
  out_ids_BxC: jax.Array  # tokens of the last chunk: row b's are columns [0, its count in that chunk)
  out_logp_BxC: jax.Array
  adapter_B: jax.Array  # the row's slot in the adapter stack (-1: the base); unused without a stack


@functools.lru_cache(maxsize=None)
def cache_axes(cfg: model_config.ModelConfig) -> tuple[tuple[int, int], ...]:
  """(batch axis, slot axis) of every cache leaf, by comparing abstract caches of different sizes."""
  shapes = [jax.tree.leaves(jax.eval_shape(lambda b=b, s=s: model_lib.init_cache(cfg, b, s)))
            for b, s in ((3, 5), (4, 5), (3, 7))]

  def changed(a, b):
    axes = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if len(axes) != 1:
      raise ValueError(f"cannot find the batch/slot axis of a cache leaf: {a.shape} vs {b.shape}")
    return axes[0]

  return tuple((changed(a, b), changed(a, c)) for a, b, c in zip(*shapes))


def _write_rows(cfg, big, small, slots_J):
  """Writes a J-row cache of P slots into rows slots_J (out of range: dropped), slots [0, P), of the pool's."""
  big_leaves, treedef = jax.tree.flatten(big)
  out = []
  for x, y, (b_axis, s_axis) in zip(big_leaves, jax.tree.leaves(small), cache_axes(cfg)):
    index = [slice(None)] * x.ndim
    index[b_axis], index[s_axis] = slots_J, slice(0, y.shape[s_axis])
    out.append(x.at[tuple(index)].set(y, mode="drop"))  # one array index: y's layout as it is
  return jax.tree.unflatten(treedef, out)


def _take_rows(cfg, cache, src_N):
  leaves, treedef = jax.tree.flatten(cache)
  return jax.tree.unflatten(treedef, [jnp.take(x, src_N, axis=b_axis)
                                      for x, (b_axis, _) in zip(leaves, cache_axes(cfg))])


def num_slots(pool: PoolState, cfg) -> int:
  return int(jax.tree.leaves(pool.cache)[0].shape[cache_axes(cfg)[0][1]])


@functools.partial(jax.jit, static_argnames=("cfg", "B", "S", "C", "K", "cache_dtype"))
def empty(*, cfg, B, S, C, K, cache_dtype):
  """A pool of B free slots with an S-slot cache per row in `cache_dtype`."""
  V = cfg.vocab_size
  cache = jax.tree.map(lambda x: x.astype(cache_dtype), model_lib.init_cache(cfg, B, S))
  zeros_i = jnp.zeros((B,), jnp.int32)
  rows = jax.tree.map(jnp.asarray, sampling_fields.row_arrays((), B, K, V)[0])
  return PoolState(cache, rows, zeros_i, zeros_i, zeros_i, jnp.ones((B,), bool), jnp.zeros((B,), bool),
                   jnp.zeros((B, C), jnp.int32), jnp.zeros((B, C), jnp.float32), jnp.full((B,), -1, jnp.int32))


class Joined(NamedTuple):
  """Prefilled rows, ready to be placed in a pool (`place`)."""
  cache: tuple  # J rows x P slots
  rows: sampling_fields.RowArrays
  lens_J: jax.Array
  token_J: jax.Array
  logp_J: jax.Array
  done_J: jax.Array
  stopped_J: jax.Array
  prompt_logp_JxP: jax.Array
  adapter_J: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "cache_dtype"))
def prefill(params, tokens_JxP, lens_J, rows_J: sampling_fields.RowArrays, seeds_Jx2, adapter=None,
            adapter_J=None, *, cfg, cache_dtype) -> Joined:
  """Prefills J right-padded prompts and samples their token 0. Compiled per (J, P) only, not per pool size:
  the model's compile is the expensive one, and `place` (per pool size) holds no model."""
  J, P = tokens_JxP.shape
  small = jax.tree.map(lambda s: s.astype(cache_dtype), model_lib.init_cache(cfg, J, P))
  positions_JxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (J, P))
  # Right padding: the causal mask alone hides the pad slots from every real prompt token.
  if adapter_J is None:
    adapter_J = jnp.full((J,), -1, jnp.int32)
  x_JxPxD, small = model_lib.decode(params, cfg, tokens_JxP, positions_JxP, small, 0, jnp.ones((J, P), bool),
                                    head=False, **_lora_args(adapter, adapter_J))
  prompt_logp_JxP, last_JxV = model_lib.prompt_logprobs_and_logits(params, cfg, x_JxPxD, tokens_JxP, lens_J - 1)
  rows_J = rows_J._replace(key_data_Bx2=kernels.row_keys(seeds_Jx2))
  active_J = rows_J.max_new_B > 0
  token_J, logp_J, stop_J = kernels.draw(last_JxV, rows_J, jnp.zeros_like(lens_J), active_J)
  done_J = ~active_J | stop_J | (active_J.astype(jnp.int32) >= rows_J.max_new_B)
  return Joined(small, rows_J, lens_J, token_J, logp_J, done_J, stop_J, prompt_logp_JxP, adapter_J)


def _lora_args(adapter, adapter_B) -> dict:
  """The model's adapter arguments: none without a stack (the base model's program, unchanged)."""
  return {} if adapter is None else {"adapter": adapter, "adapter_B": adapter_B}


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("pool",))
def place(pool: PoolState, joined: Joined, slots_J, *, cfg) -> PoolState:
  """Writes prefilled rows into pool slots `slots_J` (an index >= B: that row is dropped, e.g. padding)."""
  def put(x, y):
    return x.at[slots_J].set(y, mode="drop")

  num_gen_J = (joined.rows.max_new_B > 0).astype(jnp.int32)
  return pool._replace(
      cache=_write_rows(cfg, pool.cache, joined.cache, slots_J), rows=jax.tree.map(put, pool.rows, joined.rows),
      index_B=put(pool.index_B, joined.lens_J), last_token_B=put(pool.last_token_B, joined.token_J),
      num_gen_B=put(pool.num_gen_B, num_gen_J), done_B=put(pool.done_B, joined.done_J),
      stopped_B=put(pool.stopped_B, joined.stopped_J), adapter_B=put(pool.adapter_B, joined.adapter_J))


def admit(params, pool: PoolState, tokens_JxP, lens_J, slots_J, rows_J: sampling_fields.RowArrays, seeds_Jx2,
          adapter=None, adapter_J=None, *, cfg):
  """Prefills J right-padded prompts, samples their token 0 and writes them into `slots_J` (B: dropped);
  with a stack, row j uses its slot adapter_J[j] (-1: the base), now and in every later step.

  Returns the pool and, per joining row, (token 0, its log-prob, done, stopped, prompt log-probs [J, P]).
  """
  cache_dtype = jax.tree.leaves(pool.cache)[0].dtype
  joined = prefill(params, tokens_JxP, lens_J, rows_J, seeds_Jx2, adapter, adapter_J, cfg=cfg,
                   cache_dtype=cache_dtype)
  pool = place(pool, joined, slots_J, cfg=cfg)
  return pool, (joined.token_J, joined.logp_J, joined.done_J, joined.stopped_J, joined.prompt_logp_JxP)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("pool",))
def steps(params, pool: PoolState, live_B, adapter=None, *, cfg):
  """Up to C one-token steps of every live, unfinished row (each with its own adapter slot when `adapter`
  is a stack); slots not live are finished first."""
  B, C = pool.out_ids_BxC.shape
  S = num_slots(pool, cfg)
  everything_BxS = jnp.ones((B, S), bool)  # each row's own cache index bounds what it sees

  def cond(carry):
    i, p = carry
    return (i < C) & ~jnp.all(p.done_B)

  def body(carry):
    i, p = carry
    logits_Bx1xV, cache = model_lib.decode(params, cfg, p.last_token_B[:, None], p.index_B[:, None], p.cache,
                                           p.index_B, everything_BxS, **_lora_args(adapter, p.adapter_B))
    active_B = ~p.done_B
    token_B, logp_B, stop_B = kernels.draw(logits_Bx1xV[:, 0], p.rows, p.num_gen_B, active_B)
    step_B = active_B.astype(jnp.int32)
    num_gen_B = p.num_gen_B + step_B
    return i + 1, p._replace(
        cache=cache, index_B=p.index_B + step_B, last_token_B=jnp.where(active_B, token_B, p.last_token_B),
        num_gen_B=num_gen_B, done_B=p.done_B | stop_B | (num_gen_B >= p.rows.max_new_B),
        stopped_B=p.stopped_B | stop_B,
        out_ids_BxC=p.out_ids_BxC.at[:, i].set(jnp.where(active_B, token_B, 0)),
        out_logp_BxC=p.out_logp_BxC.at[:, i].set(jnp.where(active_B, logp_B, 0.0)))

  pool = pool._replace(done_B=pool.done_B | ~live_B)
  return jax.lax.while_loop(cond, body, (jnp.int32(0), pool))[1]


@functools.partial(jax.jit, static_argnames=("cfg",))
def take(pool: PoolState, src_N, *, cfg):
  """A pool of N slots: slot n holds old slot src_N[n], or is free where src_N[n] < 0 (grow / compact)."""
  keep_N = src_N >= 0
  src_N = jnp.maximum(src_N, 0)
  gather = lambda x: x[src_N]
  return PoolState(
      cache=_take_rows(cfg, pool.cache, src_N), rows=jax.tree.map(gather, pool.rows),
      index_B=jnp.where(keep_N, pool.index_B[src_N], 0), last_token_B=gather(pool.last_token_B),
      num_gen_B=gather(pool.num_gen_B), done_B=jnp.where(keep_N, pool.done_B[src_N], True),
      stopped_B=gather(pool.stopped_B), out_ids_BxC=gather(pool.out_ids_BxC),
      out_logp_BxC=gather(pool.out_logp_BxC), adapter_B=jnp.where(keep_N, pool.adapter_B[src_N], -1))
