"""Jitted decode kernels: the filtered token draw, prefill and lockstep decode steps with raw per-token log-probs.

Shape letters as in sampling.py: B rows, P prompt slots, N new-token slots, S = P + N cache slots, V vocab,
K stop ids per row.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from vcpo_jax.model import sampling_fields
from vcpo_jax.model import transformer as model_lib

GREEDY_TEMPERATURE = 1e-5  # at or below this, decode greedily (SGLang does the same for ~0 temperatures)


class DecodeState(NamedTuple):
  """Device state of a batch being decoded; every row advances one token per step in lockstep."""
  cache: tuple | None
  key_mask_BxS: jax.Array  # False on left-pad slots
  prompt_len_B: jax.Array  # real prompt length: positions of generated tokens continue from it
  last_token_B: jax.Array
  step: jax.Array  # tokens sampled so far in this batch (scalar)
  num_gen_B: jax.Array
  done_B: jax.Array
  stopped_B: jax.Array  # finished on a stop token
  out_ids_BxN: jax.Array
  out_logp_BxN: jax.Array
  rows: sampling_fields.RowArrays


def top_k_top_p(scaled_BxV, top_k_B, top_p_B):
  """Masks to -inf all but the top-k, then all but the smallest prefix with mass >= top_p (ties kept)."""
  V = scaled_BxV.shape[-1]
  sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)
  in_k_BxV = jnp.arange(V, dtype=jnp.int32)[None, :] < top_k_B[:, None]
  probs_BxV = jax.nn.softmax(jnp.where(in_k_BxV, sorted_BxV, -jnp.inf), axis=-1)
  mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  keep_BxV = in_k_BxV & (mass_before_BxV < top_p_B[:, None])
  num_keep_B = jnp.maximum(jnp.sum(keep_BxV, axis=-1), 1)
  thresh_B = jnp.take_along_axis(sorted_BxV, (num_keep_B - 1)[:, None], axis=-1)[:, 0]
  return jnp.where(scaled_BxV >= thresh_B[:, None], scaled_BxV, -jnp.inf)


def sample_tokens(logits_BxV, temperature_B, top_p_B, top_k_B, min_p_B, keys_B):
  """Draws one token per row from the temperature/top-k/top-p/min-p filtered distribution.

  Each [B, V] pass a batch does not need is skipped at run time (lax.cond on what its rows ask for): a batch
  of plain temperature draws (RL rollouts) makes one pass for the Gumbel-max draw; an all-greedy batch (eval)
  makes one argmax. The tokens are those of the full path: the skipped passes change nothing for such rows.
  """
  greedy_B = temperature_B <= GREEDY_TEMPERATURE
  return jax.lax.cond(jnp.all(greedy_B), lambda *a: jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32),
                      _sampled_tokens, logits_BxV, greedy_B, temperature_B, top_p_B, top_k_B, min_p_B, keys_B)


def _sampled_tokens(logits_BxV, greedy_B, temperature_B, top_p_B, top_k_B, min_p_B, keys_B):
  V = logits_BxV.shape[-1]
  scaled_BxV = logits_BxV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
  needs_sort = jnp.any((top_k_B < V) | (top_p_B < 1.0))
  scaled_BxV = jax.lax.cond(needs_sort, top_k_top_p, lambda s, k, p: s, scaled_BxV, top_k_B, top_p_B)
  scaled_BxV = jax.lax.cond(jnp.any(min_p_B > 0), _min_p, lambda s, m: s, scaled_BxV, min_p_B)
  sampled_B = jax.vmap(jax.random.categorical)(keys_B, scaled_BxV).astype(jnp.int32)
  return jax.lax.cond(jnp.any(greedy_B),
                      lambda: jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), sampled_B),
                      lambda: sampled_B)


def _min_p(scaled_BxV, min_p_B):
  # min_p keeps tokens with p >= min_p * p_max, i.e. scaled logit >= max + log(min_p); log(0) = -inf.
  max_B = jnp.max(scaled_BxV, axis=-1)
  return jnp.where(scaled_BxV >= (max_B + jnp.log(min_p_B))[:, None], scaled_BxV, -jnp.inf)


def _suppress_stops(logits_BxV, stop_ids_BxK, suppress_B):
  """-inf on each suppressed row's stop ids (min_new_tokens not reached yet)."""
  B, V = logits_BxV.shape
  rows_BxK = jnp.broadcast_to(jnp.arange(B)[:, None], stop_ids_BxK.shape)
  is_stop_BxV = jnp.zeros((B, V), bool).at[rows_BxK, stop_ids_BxK].set(True, mode="drop")
  return jnp.where(suppress_B[:, None] & is_stop_BxV, -jnp.inf, logits_BxV)


def draw(logits_BxV, rows: sampling_fields.RowArrays, count_B, active_B):
  """Token number count_B of each row, its raw log-prob and whether it hits a stop id (active rows only).

  `rows` holds the per-row sampling fields. The random key is fold_in(row key, sample_offset + count): a
  row's draws depend on its own stream and count only.
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  logz_B = jax.nn.logsumexp(logits_BxV, axis=-1)
  # min_new_tokens: stop tokens cannot be drawn before it (they only change what is sampled).
  suppress_B = (count_B < rows.min_new_B) & ~rows.ignore_eos_B
  sample_logits_BxV = jax.lax.cond(jnp.any(suppress_B), _suppress_stops, lambda x, i, s: x, logits_BxV,
                                   rows.stop_ids_BxK, suppress_B)
  keys_B = jax.vmap(lambda kd, i: jax.random.fold_in(jax.random.wrap_key_data(kd), i))(
      rows.key_data_Bx2, rows.sample_offset_B + count_B)
  token_B = sample_tokens(sample_logits_BxV, rows.temperature_B, rows.top_p_B, rows.top_k_B, rows.min_p_B,
                          keys_B)
  logp_B = jnp.take_along_axis(logits_BxV, token_B[:, None], axis=-1)[:, 0] - logz_B
  hit_stop_B = jnp.any(token_B[:, None] == rows.stop_ids_BxK, axis=-1) & ~rows.ignore_eos_B & active_B
  return token_B, logp_B, hit_stop_B


def sample_step(logits_BxV, st: DecodeState) -> DecodeState:
  """Samples token `st.step` of every row from next-token logits and updates the finish flags."""
  active_B = ~st.done_B
  token_B, logp_B, hit_stop_B = draw(logits_BxV, st.rows, jnp.broadcast_to(st.step, active_B.shape), active_B)
  num_gen_B = st.num_gen_B + active_B.astype(jnp.int32)
  return st._replace(
      last_token_B=token_B,
      step=st.step + 1,
      num_gen_B=num_gen_B,
      done_B=st.done_B | hit_stop_B | (num_gen_B >= st.rows.max_new_B),
      stopped_B=st.stopped_B | hit_stop_B,
      out_ids_BxN=st.out_ids_BxN.at[:, st.step].set(jnp.where(active_B, token_B, 0)),
      out_logp_BxN=st.out_logp_BxN.at[:, st.step].set(jnp.where(active_B, logp_B, 0.0)),
  )


def row_keys(seeds_Bx2):
  """Raw key data of each row's stream: fold_in(key(seed), stream) for (seed, stream) pairs."""
  return jax.vmap(lambda s: jax.random.key_data(jax.random.fold_in(jax.random.key(s[0]), s[1])))(seeds_Bx2)


@functools.partial(jax.jit, static_argnames=("cfg", "num_new"))
def prefill(params, tokens_BxP, positions_BxP, seeds_Bx2, st: DecodeState, *, cfg, num_new):
  """Writes the prompts' K/V at slots [0, P), samples token 0, returns state and prompt log-probs."""
  B, P = tokens_BxP.shape
  cache = model_lib.init_cache(cfg, B, P + num_new)
  x_BxPxD, cache = model_lib.decode(params, cfg, tokens_BxP, positions_BxP, cache, 0, st.key_mask_BxS,
                                    head=False)
  prompt_logp_BxP, last_BxV = model_lib.prompt_logprobs_and_logits(params, cfg, x_BxPxD, tokens_BxP,
                                                                   jnp.full((B,), P - 1, jnp.int32))
  st = st._replace(cache=cache, rows=st.rows._replace(key_data_Bx2=row_keys(seeds_Bx2)))
  return sample_step(last_BxV, st), prompt_logp_BxP


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill_no_cache(params, tokens_BxP, positions_BxP, seeds_Bx2, st: DecodeState, *, cfg):
  """The no-cache baseline's prefill: a plain forward over the prompts, then token 0."""
  B, P = tokens_BxP.shape
  x_BxPxD = model_lib.hidden_states(params, cfg, tokens_BxP, positions_BxP, st.key_mask_BxS[:, :P])
  prompt_logp_BxP, last_BxV = model_lib.prompt_logprobs_and_logits(params, cfg, x_BxPxD, tokens_BxP,
                                                                   jnp.full((B,), P - 1, jnp.int32))
  st = st._replace(rows=st.rows._replace(key_data_Bx2=row_keys(seeds_Bx2)))
  return sample_step(last_BxV, st), prompt_logp_BxP


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps"), donate_argnames=("st",))
def decode_steps(params, st: DecodeState, *, cfg, num_steps):
  """Up to `num_steps` one-token decode steps; stops early once every row is done."""
  N = st.out_ids_BxN.shape[1]
  P = st.key_mask_BxS.shape[1] - N

  def cond(carry):
    i, s = carry
    return (i < num_steps) & (s.step < N) & ~jnp.all(s.done_B)

  def body(carry):
    i, s = carry
    # The last sampled token goes to slot P + step - 1; its position continues the real prompt.
    positions_Bx1 = (s.prompt_len_B + s.step - 1)[:, None]
    logits_Bx1xV, cache = model_lib.decode(params, cfg, s.last_token_B[:, None], positions_Bx1, s.cache,
                                           P + s.step - 1, s.key_mask_BxS)
    return i + 1, sample_step(logits_Bx1xV[:, 0], s._replace(cache=cache))

  return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps"))
def no_cache_steps(params, tokens_BxP, st: DecodeState, *, cfg, num_steps):
  """Like decode_steps but recomputes the full sequence each step (the no-KV-cache baseline)."""
  N = st.out_ids_BxN.shape[1]
  P = tokens_BxP.shape[1]
  pad_B = P - st.prompt_len_B
  positions_BxS = jnp.maximum(jnp.arange(P + N, dtype=jnp.int32)[None, :] - pad_B[:, None], 0)

  def cond(carry):
    i, s = carry
    return (i < num_steps) & (s.step < N) & ~jnp.all(s.done_B)

  def body(carry):
    i, s = carry
    # out_ids already holds every sampled token; slots after step - 1 are causally invisible.
    tokens_BxS = jnp.concatenate([tokens_BxP, s.out_ids_BxN], axis=1)
    logits_BxSxV = model_lib.forward(params, cfg, tokens_BxS, positions_BxS, s.key_mask_BxS)
    logits_BxV = jax.lax.dynamic_index_in_dim(logits_BxSxV, P + s.step - 1, axis=1, keepdims=False)
    return i + 1, sample_step(logits_BxV, s)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]
