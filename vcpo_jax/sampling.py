"""Batched jitted decoding with a KV cache; per-token log-probs are those of the raw (temperature-1) model.

Why raw log-probs: the learner recomputes log pi(token) at temperature 1 with no top-p/top-k truncation
(`model.token_logprobs`), and importance ratios compare like with like. So every returned log-prob is
log softmax(logits)[token] of the unmodified model, whatever temperature/top-p/top-k/min-p chose the token.

Shape letters: B batch rows (bucketed), P prompt slots (left-padded), N new-token slots, S = P + N cache
slots, V vocab, K stop ids per row.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import model as model_lib

GREEDY_TEMPERATURE = 1e-5  # at or below this, decode greedily (SGLang does the same for ~0 temperatures)


@dataclasses.dataclass(frozen=True)
class RowSpec:
  """One row to generate. `seed`/`stream` pick the row's private random stream (stream = sample index)."""
  prompt: tuple[int, ...]
  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  min_new_tokens: int = 0
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  seed: int = 0
  stream: int = 0
  # Tokens this row already generated before (a resumed row): advances the random stream so a resumed
  # row draws the same numbers it would have drawn uninterrupted.
  sample_offset: int = 0


@dataclasses.dataclass
class RowResult:
  output_ids: list[int]
  logprobs: list[float]
  finished: bool
  finish_reason: str | None  # "stop" | "length" | None (unfinished)
  matched_token: int | None
  prompt_logprobs: list[float]  # log p(prompt[t] | prompt[:t]) for t >= 1


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
  temperature_B: jax.Array
  top_p_B: jax.Array
  top_k_B: jax.Array  # V when disabled
  min_p_B: jax.Array
  min_new_B: jax.Array
  max_new_B: jax.Array
  ignore_eos_B: jax.Array
  stop_ids_BxK: jax.Array  # padded with V (never a token)
  key_data_Bx2: jax.Array
  sample_offset_B: jax.Array


def bucket(n: int, minimum: int) -> int:
  """Smallest power of two >= max(n, minimum): jit compiles a handful of shapes, not one per size."""
  size = max(int(minimum), 1)
  while size < n:
    size *= 2
  return size


def _top_k_top_p(scaled_BxV, top_k_B, top_p_B):
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
  """Draws one token per row from the temperature/top-k/top-p/min-p filtered distribution."""
  V = logits_BxV.shape[-1]
  greedy_B = temperature_B <= GREEDY_TEMPERATURE
  scaled_BxV = logits_BxV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
  needs_sort = jnp.any((top_k_B < V) | (top_p_B < 1.0))
  scaled_BxV = jax.lax.cond(needs_sort, _top_k_top_p, lambda s, k, p: s, scaled_BxV, top_k_B, top_p_B)
  # min_p keeps tokens with p >= min_p * p_max, i.e. scaled logit >= max + log(min_p); log(0) = -inf.
  max_B = jnp.max(scaled_BxV, axis=-1)
  scaled_BxV = jnp.where(scaled_BxV >= (max_B + jnp.log(min_p_B))[:, None], scaled_BxV, -jnp.inf)
  sampled_B = jax.vmap(jax.random.categorical)(keys_B, scaled_BxV)
  return jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1), sampled_B).astype(jnp.int32)


def _sample_step(logits_BxV, st: DecodeState) -> DecodeState:
  """Samples token `st.step` of every row from next-token logits and updates the finish flags."""
  B, V = logits_BxV.shape
  logits_BxV = logits_BxV.astype(jnp.float32)
  logz_B = jax.nn.logsumexp(logits_BxV, axis=-1)
  # min_new_tokens: stop tokens cannot be drawn before it (they only change what is sampled).
  rows_BxK = jnp.broadcast_to(jnp.arange(B)[:, None], st.stop_ids_BxK.shape)
  is_stop_BxV = jnp.zeros((B, V), bool).at[rows_BxK, st.stop_ids_BxK].set(True, mode="drop")
  suppress_B = (st.step < st.min_new_B) & ~st.ignore_eos_B
  sample_logits_BxV = jnp.where(suppress_B[:, None] & is_stop_BxV, -jnp.inf, logits_BxV)
  keys_B = jax.vmap(lambda kd, i: jax.random.fold_in(jax.random.wrap_key_data(kd), i))(
      st.key_data_Bx2, st.sample_offset_B + st.step)
  token_B = sample_tokens(sample_logits_BxV, st.temperature_B, st.top_p_B, st.top_k_B, st.min_p_B, keys_B)
  logp_B = jnp.take_along_axis(logits_BxV, token_B[:, None], axis=-1)[:, 0] - logz_B
  active_B = ~st.done_B
  hit_stop_B = jnp.any(token_B[:, None] == st.stop_ids_BxK, axis=-1) & ~st.ignore_eos_B & active_B
  num_gen_B = st.num_gen_B + active_B.astype(jnp.int32)
  return st._replace(
      last_token_B=token_B,
      step=st.step + 1,
      num_gen_B=num_gen_B,
      done_B=st.done_B | hit_stop_B | (num_gen_B >= st.max_new_B),
      stopped_B=st.stopped_B | hit_stop_B,
      out_ids_BxN=st.out_ids_BxN.at[:, st.step].set(jnp.where(active_B, token_B, 0)),
      out_logp_BxN=st.out_logp_BxN.at[:, st.step].set(jnp.where(active_B, logp_B, 0.0)),
  )


def _row_keys(seeds_Bx2):
  """Raw key data of each row's stream: fold_in(key(seed), stream) for (seed, stream) pairs."""
  return jax.vmap(lambda s: jax.random.key_data(jax.random.fold_in(jax.random.key(s[0]), s[1])))(seeds_Bx2)


@functools.partial(jax.jit, static_argnames=("cfg", "num_new"))
def _prefill(params, tokens_BxP, positions_BxP, seeds_Bx2, st: DecodeState, *, cfg, num_new):
  """Writes the prompts' K/V at slots [0, P), samples token 0, returns state and prompt log-probs."""
  B, P = tokens_BxP.shape
  cache = model_lib.init_cache(cfg, B, P + num_new)
  logits_BxPxV, cache = model_lib.decode(params, cfg, tokens_BxP, positions_BxP, cache, 0, st.key_mask_BxS)
  prompt_logp_BxP = model_lib.logprobs_from_logits(logits_BxPxV, tokens_BxP, jnp.ones_like(tokens_BxP))[0]
  st = st._replace(cache=cache, key_data_Bx2=_row_keys(seeds_Bx2))
  return _sample_step(logits_BxPxV[:, -1], st), prompt_logp_BxP


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill_no_cache(params, tokens_BxP, positions_BxP, seeds_Bx2, st: DecodeState, *, cfg):
  """The no-cache baseline's prefill: a plain forward over the prompts, then token 0."""
  P = tokens_BxP.shape[1]
  logits_BxPxV = model_lib.forward(params, cfg, tokens_BxP, positions_BxP, st.key_mask_BxS[:, :P])
  prompt_logp_BxP = model_lib.logprobs_from_logits(logits_BxPxV, tokens_BxP, jnp.ones_like(tokens_BxP))[0]
  st = st._replace(key_data_Bx2=_row_keys(seeds_Bx2))
  return _sample_step(logits_BxPxV[:, -1], st), prompt_logp_BxP


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps"), donate_argnames=("st",))
def _decode_steps(params, st: DecodeState, *, cfg, num_steps):
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
    return i + 1, _sample_step(logits_Bx1xV[:, 0], s._replace(cache=cache))

  return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps"))
def _no_cache_steps(params, tokens_BxP, st: DecodeState, *, cfg, num_steps):
  """Like _decode_steps but recomputes the full sequence each step (the no-KV-cache baseline)."""
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
    return i + 1, _sample_step(logits_BxV, s)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), st))[1]


@dataclasses.dataclass
class DecodeBatch:
  """A batch in flight: device state plus what the host needs to read results back."""
  state: DecodeState
  num_rows: int
  prompt_lens: list[int]
  prompt_tokens_BxP: jax.Array
  prompt_logp_BxP: jax.Array | None
  cfg: model_lib.ModelConfig

  @property
  def capacity(self) -> int:
    return int(self.state.out_ids_BxN.shape[1])


def _validate_rows(rows: Sequence[RowSpec], cfg: model_lib.ModelConfig):
  if not rows:
    raise ValueError("rows must be non-empty")
  for r, row in enumerate(rows):
    if not row.prompt:
      raise ValueError(f"rows[{r}].prompt must be non-empty")
    bad = [t for t in row.prompt if not 0 <= t < cfg.vocab_size]
    if bad:
      raise ValueError(f"rows[{r}].prompt has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    bad = [t for t in row.stop_token_ids if not 0 <= t < cfg.vocab_size]
    if bad:
      raise ValueError(f"rows[{r}].stop_token_ids has ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    if row.max_new_tokens < 0:
      raise ValueError(f"rows[{r}].max_new_tokens must be >= 0, got {row.max_new_tokens}")


def _initial_state(rows, cfg, B, P, N, K) -> tuple[DecodeState, np.ndarray, np.ndarray, np.ndarray]:
  """Host-built arrays: state (no cache, no keys yet), left-padded prompts, positions, (seed, stream)s."""
  V = cfg.vocab_size
  n = len(rows)
  tokens = np.zeros((B, P), np.int32)
  positions = np.zeros((B, P), np.int32)
  key_mask = np.ones((B, P + N), bool)
  prompt_len = np.ones((B,), np.int32)
  stop_ids = np.full((B, K), V, np.int32)
  for b, row in enumerate(rows):
    L = len(row.prompt)
    tokens[b, P - L:] = row.prompt
    positions[b, P - L:] = np.arange(L)
    key_mask[b, :P - L] = False
    prompt_len[b] = L
    stop_ids[b, :len(row.stop_token_ids)] = row.stop_token_ids
  key_mask[n:, :P - 1] = False  # filler rows: a one-token prompt of id 0

  def per_row(fn, dtype, fill):
    return jnp.asarray(np.array([fn(r) for r in rows] + [fill] * (B - n), dtype))

  st = DecodeState(
      cache=None, key_mask_BxS=jnp.asarray(key_mask), prompt_len_B=jnp.asarray(prompt_len),
      last_token_B=jnp.zeros((B,), jnp.int32), step=jnp.int32(0), num_gen_B=jnp.zeros((B,), jnp.int32),
      done_B=jnp.asarray(np.array([r.max_new_tokens == 0 for r in rows] + [True] * (B - n))),
      stopped_B=jnp.zeros((B,), bool), out_ids_BxN=jnp.zeros((B, N), jnp.int32),
      out_logp_BxN=jnp.zeros((B, N), jnp.float32),
      temperature_B=per_row(lambda r: r.temperature, np.float32, 0.0),
      top_p_B=per_row(lambda r: r.top_p, np.float32, 1.0),
      top_k_B=per_row(lambda r: V if r.top_k <= 0 else min(r.top_k, V), np.int32, V),
      min_p_B=per_row(lambda r: r.min_p, np.float32, 0.0),
      min_new_B=per_row(lambda r: r.min_new_tokens, np.int32, 0),
      max_new_B=per_row(lambda r: r.max_new_tokens, np.int32, 0),
      ignore_eos_B=per_row(lambda r: r.ignore_eos, bool, True),
      stop_ids_BxK=jnp.asarray(stop_ids),
      key_data_Bx2=jnp.zeros((B, 2), jnp.uint32),  # set by the jitted prefill
      sample_offset_B=per_row(lambda r: r.sample_offset, np.int32, 0),
  )
  seeds = np.array([[r.seed % 2**32, r.stream % 2**32] for r in rows] + [[0, 0]] * (B - n), np.uint32)
  return st, tokens, positions, seeds


def start_batch(params, cfg: model_lib.ModelConfig, rows: Sequence[RowSpec], *, min_batch: int = 1,
                min_prompt_len: int = 16, min_new_tokens: int = 16, use_cache: bool = True) -> DecodeBatch:
  """Left-pads the prompts into power-of-two buckets, prefills the cache and samples each row's token 0."""
  _validate_rows(rows, cfg)
  B = bucket(len(rows), min_batch)
  P = bucket(max(len(r.prompt) for r in rows), min_prompt_len)
  N = bucket(max(r.max_new_tokens for r in rows), min_new_tokens)
  K = bucket(max(len(r.stop_token_ids) for r in rows), 4)
  longest = max(len(r.prompt) + r.max_new_tokens for r in rows)
  if longest > cfg.max_seq_len:
    raise ValueError(f"prompt + max_new_tokens = {longest} exceeds model.max_seq_len={cfg.max_seq_len}")
  st, tokens, positions, seeds = _initial_state(rows, cfg, B, P, N, K)
  tokens, positions, seeds = jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(seeds)
  if use_cache:
    st, prompt_logp = _prefill(params, tokens, positions, seeds, st, cfg=cfg, num_new=N)
  else:
    st, prompt_logp = _prefill_no_cache(params, tokens, positions, seeds, st, cfg=cfg)
  return DecodeBatch(st, len(rows), [len(r.prompt) for r in rows], tokens, prompt_logp, cfg)


def decode_chunk(params, batch: DecodeBatch, num_steps: int, *, use_cache: bool = True) -> DecodeBatch:
  """Advances the batch by up to `num_steps` tokens (fewer if every row finishes)."""
  if use_cache:
    batch.state = _decode_steps(params, batch.state, cfg=batch.cfg, num_steps=num_steps)
  else:
    batch.state = _no_cache_steps(params, batch.prompt_tokens_BxP, batch.state, cfg=batch.cfg,
                                  num_steps=num_steps)
  return batch


def progress(batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Host copies of (out_ids_BxN, out_logp_BxN, num_gen_B, done_B, stopped_B) for the real rows."""
  st = jax.device_get((batch.state.out_ids_BxN, batch.state.out_logp_BxN, batch.state.num_gen_B,
                       batch.state.done_B, batch.state.stopped_B))
  return tuple(np.asarray(a)[:batch.num_rows] for a in st)


def results(batch: DecodeBatch) -> list[RowResult]:
  """Per-row outputs so far; unfinished rows have finished=False and finish_reason None."""
  ids, logp, num_gen, done, stopped = progress(batch)
  prompt_logp = np.asarray(jax.device_get(batch.prompt_logp_BxP))
  P = prompt_logp.shape[1]
  out = []
  for b in range(batch.num_rows):
    n = int(num_gen[b])
    reason = None if not done[b] else ("stop" if stopped[b] else "length")
    out.append(RowResult(
        output_ids=ids[b, :n].tolist(), logprobs=logp[b, :n].tolist(), finished=bool(done[b]),
        finish_reason=reason, matched_token=int(ids[b, n - 1]) if stopped[b] else None,
        prompt_logprobs=prompt_logp[b, P - batch.prompt_lens[b] + 1:].tolist()))
  return out


def _row_specs(prompts, *, max_new_tokens, temperature, top_p, top_k, min_p, min_new_tokens,
               stop_token_ids, ignore_eos, rng, seeds) -> list[RowSpec]:
  if seeds is None:
    key = jax.random.key(rng) if isinstance(rng, int) else (jax.random.key(0) if rng is None else rng)
    seeds = np.asarray(jax.random.randint(key, (len(prompts),), 0, 2**31 - 1)).tolist()
  if len(seeds) != len(prompts):
    raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
  return [RowSpec(prompt=tuple(int(t) for t in p), max_new_tokens=max_new_tokens, temperature=temperature,
                  top_p=top_p, top_k=top_k, min_p=min_p, min_new_tokens=min_new_tokens,
                  stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos, seed=int(s))
          for p, s in zip(prompts, seeds)]


def generate(params, cfg: model_lib.ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
             min_new_tokens: int = 0, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
             rng=None, seeds: Sequence[int] | None = None, chunk_steps: int = 64,
             use_cache: bool = True) -> list[RowResult]:
  """Generates for every prompt in one batch. `rng` (key or int) draws per-row seeds unless `seeds` given."""
  rows = _row_specs(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    top_k=top_k, min_p=min_p, min_new_tokens=min_new_tokens, stop_token_ids=stop_token_ids,
                    ignore_eos=ignore_eos, rng=rng, seeds=seeds)
  batch = start_batch(params, cfg, rows, use_cache=use_cache)
  while not bool(jnp.all(batch.state.done_B)):
    decode_chunk(params, batch, chunk_steps, use_cache=use_cache)
  return results(batch)


def generate_no_cache(params, cfg: model_lib.ModelConfig, prompts: Sequence[Sequence[int]], **kwargs):
  """`generate` without a KV cache (a full forward per token): the baseline for the decode benchmark."""
  return generate(params, cfg, prompts, use_cache=False, **kwargs)
