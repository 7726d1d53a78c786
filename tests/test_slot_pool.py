"""Continuous batching (slot_pool.py): rows joining mid-decode get the tokens they would get decoded alone."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import config as model_config
from vcpo_jax.model import sampling
from vcpo_jax.model import transformer as model
from vcpo_jax.serving import pool_kernels
from vcpo_jax.serving import slot_pool

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, max_seq_len=64)
# One pool shape for most tests (4 slots, 4 steps per chunk): few compiles.
POOL = dict(max_rows=4, num_slots=CFG.max_seq_len, chunk_steps=4, min_rows=4)


@pytest.fixture(scope="module")
def params():
  p = model.init_params(CFG, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, p)


def _spec(prompt, n, seed, **kw):
  return sampling.RowSpec(prompt=tuple(prompt), max_new_tokens=n, seed=seed, **kw)


def _alone(params, spec):
  """The row decoded by itself, in a pool of its own."""
  return slot_pool.generate(params, CFG, [spec], **POOL)[0]


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [20, 21], [30, 31, 32, 33], [5]]
NEWS = [3, 14, 6, 0, 9, 5]


def _specs():
  return [_spec(p, n, seed=s, temperature=0.8, top_k=20) for s, (p, n) in enumerate(zip(PROMPTS, NEWS))]


def test_queued_rows_join_as_others_finish_and_match_their_solo_runs(params):
  """6 rows through 4 slots: the last two join when the first rows leave; each row's output is its own."""
  specs = _specs()
  pooled = slot_pool.generate(params, CFG, specs, **POOL)
  for n, spec, got in zip(NEWS, specs, pooled):
    want = _alone(params, spec)
    assert got.output_ids == want.output_ids and len(got.output_ids) == n and got.finish_reason == "length"
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got.prompt_logprobs, want.prompt_logprobs, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_growing_and_compacting_pool_gives_the_same_rows(params):
  """The same rows through 2..4 slots (the pool grows, then compacts as rows leave): outputs unchanged."""
  specs = _specs()
  pooled = slot_pool.generate(params, CFG, specs, max_rows=4, num_slots=CFG.max_seq_len, chunk_steps=4,
                              min_rows=2)
  for spec, got in zip(specs, pooled):
    want = _alone(params, spec)
    assert got.output_ids == want.output_ids and got.finish_reason == want.finish_reason
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6, rtol=0)


def test_row_joins_mid_decode_and_matches_its_solo_run(params):
  long, short = _spec([1, 2, 3], 20, seed=5), _spec([7, 8], 6, seed=6, temperature=0.7, top_p=0.9)
  pool = slot_pool.SlotPool(CFG, **POOL)
  out = {"long": [], "short": []}
  for t in pool.join(params, [long], ["long"]):
    out["long"] += t.ids
  for t in pool.step(params):
    out["long"] += t.ids
  assert len(out["long"]) == 5  # token 0 + one chunk of 4: mid-decode
  for t in pool.join(params, [short], ["short"]):
    out["short"] += t.ids
  finished = {}
  while pool.num_live:
    for t in pool.step(params):
      out[t.owner] += t.ids
      if t.done:
        finished[t.owner] = len(out["long"])
        pool.release(t.slot)
  assert finished["short"] < 20 == finished["long"]  # the short row left while the long one decoded
  assert out["long"] == _alone(params, long).output_ids
  assert out["short"] == _alone(params, short).output_ids


def test_resume_with_sample_offset_continues_the_same_stream(params):
  """A row released mid-way and re-joined with prompt + partial output (sample_offset) ends as if uninterrupted;
  its neighbours in the pool change meanwhile."""
  spec = _spec([3, 4, 5], 16, seed=11)
  whole = _alone(params, spec)
  pool = slot_pool.SlotPool(CFG, **POOL)
  got = []
  for t in pool.join(params, [spec, _spec([9], 16, seed=1)], ["row", "other"]):
    got += t.ids if t.owner == "row" else []
  got += next(t.ids for t in pool.step(params) if t.owner == "row")
  pool.release(0)  # retracted after 5 tokens
  k = len(got)
  rest = dataclasses.replace(spec, prompt=spec.prompt + tuple(got), max_new_tokens=16 - k, sample_offset=k)
  for t in pool.join(params, [_spec([2, 2], 3, seed=2), rest], ["third", "row"]):
    got += t.ids if t.owner == "row" else []
  while any(o == "row" for o in pool.owners):
    for t in pool.step(params):
      got += t.ids if t.owner == "row" else []
      if t.done:
        pool.release(t.slot)
  assert got == whole.output_ids


def test_stop_ids_and_min_new_tokens(params):
  free = _alone(params, _spec([1, 2, 3], 10, seed=0, temperature=0.0)).output_ids
  stop_id = free[3]
  first = free.index(stop_id)
  stopped = _alone(params, _spec([1, 2, 3], 10, seed=0, temperature=0.0, stop_token_ids=(stop_id,)))
  assert stopped.output_ids == free[:first + 1] and stopped.finish_reason == "stop"
  assert stopped.matched_token == stop_id
  delayed = _alone(params, _spec([1, 2, 3], 10, seed=0, temperature=0.0, stop_token_ids=(stop_id,),
                                 min_new_tokens=first + 2))
  assert stop_id not in delayed.output_ids[:first + 2]


@pytest.mark.slow
def test_bfloat16_kv_cache(params):
  free = _alone(params, _spec([1, 2, 3], 10, seed=0, temperature=0.0)).output_ids
  # A bfloat16 KV cache under float32 compute (--kv-cache-dtype): same greedy tokens on this sharp model.
  pool = slot_pool.SlotPool(CFG, **POOL, cache_dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(pool.state.cache)} == {jnp.dtype(jnp.bfloat16)}
  bf16 = slot_pool.generate(params, CFG, [_spec([1, 2, 3], 10, seed=0, temperature=0.0)], **POOL,
                            cache_dtype="bfloat16")[0]
  assert bf16.output_ids == free


def test_cache_axes_found_from_shapes():
  assert pool_kernels.cache_axes(CFG) == ((0, 1),) * (2 * CFG.num_layers)
  # Layers under scan: one stacked (k, v) pair [L, B, S, K, E].
  assert pool_kernels.cache_axes(dataclasses.replace(CFG, scan_layers=True)) == ((1, 2), (1, 2))


def test_rows_too_long_for_the_cache_raise_naming_the_field(params):
  pool = slot_pool.SlotPool(CFG, **{**POOL, "num_slots": 8})
  with pytest.raises(ValueError, match="max_new_tokens 6 exceeds the 8 cache slots"):
    pool.join(params, [_spec([1, 2, 3], 6, seed=0)], ["x"])
