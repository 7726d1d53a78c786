"""Batched jitted decoding with a KV cache; per-token log-probs are those of the raw (temperature-1) model.

Why raw log-probs: the learner recomputes log pi(token) at temperature 1 with no top-p/top-k truncation
(`model.token_logprobs`), and importance ratios compare like with like. So every returned log-prob is
log softmax(logits)[token] of the unmodified model, whatever temperature/top-p/top-k/min-p chose the token.

Shape letters: B batch rows (bucketed), P prompt slots (left-padded), N new-token slots, S = P + N cache
slots, V vocab, K stop ids per row.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax.model import config as model_config
from vcpo_jax.model import decode_kernels as kernels
from vcpo_jax.model import sampling_fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSpec(sampling_fields.SamplingFields):
  """One row to generate. `seed`/`stream` pick the row's private random stream (stream = sample index)."""
  prompt: tuple[int, ...]
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


def bucket(n: int, minimum: int, factor: int = 2) -> int:
  """Smallest minimum * factor**i >= n: jit compiles a handful of shapes, not one per size."""
  size = max(int(minimum), 1)
  while size < n:
    size *= factor
  return size


@dataclasses.dataclass
class DecodeBatch:
  """A batch in flight: device state plus what the host needs to read results back."""
  state: kernels.DecodeState
  num_rows: int
  prompt_lens: list[int]
  prompt_tokens_BxP: jax.Array
  prompt_logp_BxP: jax.Array | None
  cfg: model_config.ModelConfig

  @property
  def capacity(self) -> int:
    return int(self.state.out_ids_BxN.shape[1])


def _validate_rows(rows: Sequence[RowSpec], cfg: model_config.ModelConfig):
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


def _initial_state(rows, cfg, B, P, N, K) -> tuple[kernels.DecodeState, np.ndarray, np.ndarray, np.ndarray]:
  """Host-built arrays: state (no cache, no keys yet), left-padded prompts, positions, (seed, stream)s."""
  n = len(rows)
  tokens = np.zeros((B, P), np.int32)
  positions = np.zeros((B, P), np.int32)
  key_mask = np.ones((B, P + N), bool)
  prompt_len = np.ones((B,), np.int32)
  for b, row in enumerate(rows):
    L = len(row.prompt)
    tokens[b, P - L:] = row.prompt
    positions[b, P - L:] = np.arange(L)
    key_mask[b, :P - L] = False
    prompt_len[b] = L
  key_mask[n:, :P - 1] = False  # filler rows: a one-token prompt of id 0
  arrays, seeds = sampling_fields.row_arrays(rows, B, K, cfg.vocab_size)
  st = kernels.DecodeState(
      cache=None, key_mask_BxS=jnp.asarray(key_mask), prompt_len_B=jnp.asarray(prompt_len),
      last_token_B=jnp.zeros((B,), jnp.int32), step=jnp.int32(0), num_gen_B=jnp.zeros((B,), jnp.int32),
      done_B=jnp.asarray(arrays.max_new_B == 0), stopped_B=jnp.zeros((B,), bool),
      out_ids_BxN=jnp.zeros((B, N), jnp.int32), out_logp_BxN=jnp.zeros((B, N), jnp.float32),
      rows=jax.tree.map(jnp.asarray, arrays))  # key_data_Bx2 is set by the jitted prefill
  return st, tokens, positions, seeds


def start_batch(params, cfg: model_config.ModelConfig, rows: Sequence[RowSpec], *, min_batch: int = 1,
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
    st, prompt_logp = kernels.prefill(params, tokens, positions, seeds, st, cfg=cfg, num_new=N)
  else:
    st, prompt_logp = kernels.prefill_no_cache(params, tokens, positions, seeds, st, cfg=cfg)
  return DecodeBatch(st, len(rows), [len(r.prompt) for r in rows], tokens, prompt_logp, cfg)


def decode_chunk(params, batch: DecodeBatch, num_steps: int, *, use_cache: bool = True) -> DecodeBatch:
  """Advances the batch by up to `num_steps` tokens (fewer if every row finishes)."""
  if use_cache:
    batch.state = kernels.decode_steps(params, batch.state, cfg=batch.cfg, num_steps=num_steps)
  else:
    batch.state = kernels.no_cache_steps(params, batch.prompt_tokens_BxP, batch.state, cfg=batch.cfg,
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


def _row_specs(prompts, *, rng, seeds, **fields) -> list[RowSpec]:
  if seeds is None:
    key = jax.random.key(rng) if isinstance(rng, int) else (jax.random.key(0) if rng is None else rng)
    seeds = np.asarray(jax.random.randint(key, (len(prompts),), 0, 2**31 - 1)).tolist()
  if len(seeds) != len(prompts):
    raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
  if "stop_token_ids" in fields:
    fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
  return [RowSpec(prompt=tuple(int(t) for t in p), seed=int(s), **fields) for p, s in zip(prompts, seeds)]


def generate(params, cfg: model_config.ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             rng=None, seeds: Sequence[int] | None = None, chunk_steps: int = 64, use_cache: bool = True,
             **fields) -> list[RowResult]:
  """Generates for every prompt in one batch. `rng` (key or int) draws per-row seeds unless `seeds` given;
  `fields` are the rows' other sampling fields (sampling_fields.SamplingFields: temperature, top_p, ...)."""
  rows = _row_specs(prompts, max_new_tokens=max_new_tokens, rng=rng, seeds=seeds, **fields)
  batch = start_batch(params, cfg, rows, use_cache=use_cache)
  while not bool(jnp.all(batch.state.done_B)):
    decode_chunk(params, batch, chunk_steps, use_cache=use_cache)
  return results(batch)


def generate_no_cache(params, cfg: model_config.ModelConfig, prompts: Sequence[Sequence[int]], **kwargs):
  """`generate` without a KV cache (a full forward per token): the baseline for the decode benchmark."""
  return generate(params, cfg, prompts, use_cache=False, **kwargs)
