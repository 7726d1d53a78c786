"""The embedded server's engine with LoRA: a stack of adapter slots on the device, each row its own slot.

Against the learner: a row served with an adapter (written as PEFT by model/peft_export.py, read as the server
reads it) has the learner's log-probs of the adapted model (token_logprobs with the adapter, and of
lora.merge's weights); rows on slot -1 are bit-identical to an engine without LoRA, in the same batch."""
import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.model import lora, peft_export, sampling
from vcpo_jax.model import transformer as M
from vcpo_jax.serving import adapters
from vcpo_jax.serving import engine as engine_lib

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=8, max_seq_len=64)
LEARNER = model_config.LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
SETTINGS = adapters.Settings(max_rank=8, targets=("q_proj", "k_proj", "v_proj", "down_proj"), num_slots=3)
PROMPTS = [(1, 2, 3), (4, 5, 6, 7, 8, 9), (10, 11)]
N = 10


def _adapter(seed):
  """A trained-looking adapter: A as initialised, B random (init's B is zero)."""
  cfg = dataclasses.replace(CFG, lora=LEARNER)
  a = lora.init_adapter(jax.random.PRNGKey(seed), cfg)
  keys = iter(jax.random.split(jax.random.PRNGKey(100 + seed), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: 0.5 * jax.random.normal(next(keys), x.shape) if path[-1].key == "lora_B" else x, a)


def _served_tree(adapter, tmp_path, name):
  path = peft_export.write_adapter(adapter, CFG, LEARNER, str(tmp_path / name), dtype="float32")
  config, tensors = adapters.read_peft(path)
  adapters.check(config, tensors, CFG, SETTINGS, name)
  return adapters.to_tree(config, tensors, CFG, SETTINGS)


def _rows(slots):
  return [engine_lib.Row(spec=sampling.RowSpec(prompt=p, max_new_tokens=N, ignore_eos=True, seed=7 + i),
                         rid=f"r{i}", adapter_slot=s) for i, (p, s) in enumerate(zip(PROMPTS, slots))]


def _serve(params, rows, lora_settings=None, trees=()):
  async def run():
    eng = engine_lib.Engine(params, CFG, "v0", max_batch=4, chunk_steps=4, min_batch=4, min_prompt_len=8,
                            lora=lora_settings)
    for i, tree in trees:
      eng.set_adapter_slot(i, tree)
    eng.start()
    eng.submit(rows)
    for r in rows:
      await waits.wait_for(r.done.wait(), 300, "a row")
    await eng.stop()
    return eng
  return asyncio.run(run())


@pytest.fixture(scope="module")
def params():
  p = M.init_params(CFG, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, p)


def _learner_logprobs(params, cfg, row, adapter=None):
  tokens = jnp.asarray([list(row.spec.prompt) + row.output_ids], jnp.int32)
  return np.asarray(M.token_logprobs(params, cfg, tokens, jnp.ones(tokens.shape), adapter=adapter))[0]


@pytest.mark.slow
def test_rows_of_different_adapters_in_one_batch_match_the_learner(params, tmp_path):
  ad1, ad2 = _adapter(1), _adapter(2)
  trees = [(1, _served_tree(ad1, tmp_path, "a1")), (2, _served_tree(ad2, tmp_path, "a2"))]
  served = _rows([1, -1, 2])
  eng = _serve(params, served, SETTINGS, trees)
  assert eng.stats["num_batches"] == 1  # the three rows shared every prefill and decode step
  base = _rows([-1, -1, -1])
  _serve(params, base)  # no LoRA at all
  learner_cfg = dataclasses.replace(CFG, lora=LEARNER)
  for row, adapter in zip(served, (ad1, None, ad2)):
    assert row.finish_reason == "length" and len(row.output_ids) == N
    L = len(row.spec.prompt)
    if adapter is None:
      continue
    want = _learner_logprobs(params, learner_cfg, row, adapter)
    np.testing.assert_allclose(row.logprobs, want[L:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(row.prompt_logprobs, want[1:L], atol=1e-5, rtol=0)
    merged = _learner_logprobs(lora.merge(params, adapter, CFG, LEARNER), CFG, row)
    np.testing.assert_allclose(row.logprobs, merged[L:], atol=1e-5, rtol=0)
    assert np.abs(want[L:] - _learner_logprobs(params, CFG, row)[L:]).max() > 0.05  # the adapter matters
  # Slot -1 next to adapted rows: bit for bit the engine without LoRA.
  assert served[1].output_ids == base[1].output_ids and served[1].logprobs == base[1].logprobs
  assert served[1].prompt_logprobs == base[1].prompt_logprobs
  assert served[0].output_ids != base[0].output_ids or served[0].logprobs != base[0].logprobs


@pytest.mark.slow
def test_set_adapter_slot_empties_and_guards_live_slots(params, tmp_path):
  tree = _served_tree(_adapter(1), tmp_path, "a1")

  async def run():
    eng = engine_lib.Engine(params, CFG, "v0", max_batch=4, chunk_steps=2, min_batch=4, min_prompt_len=8,
                            lora=SETTINGS)
    eng.set_adapter_slot(0, tree)
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(eng.adapter_stack))
    eng.set_adapter_slot(0, None)
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(eng.adapter_stack))  # zeros: the base
    eng.set_adapter_slot(0, tree)
    row = _rows([0])[0]
    eng.submit([row])  # queued: slot 0 is now in use
    with pytest.raises(AssertionError, match="slot 0 changed under live rows"):
      eng.set_adapter_slot(0, None)
    eng.set_adapter_slot(1, tree)  # another slot: fine
    eng.start()
    await waits.wait_for(row.done.wait(), 300, "the row")
    eng.set_adapter_slot(0, None)  # finished: free to change
    await eng.stop()
  asyncio.run(run())
  with pytest.raises(ValueError, match="no adapter stack"):
    engine_lib.Engine(params, CFG, "v0").set_adapter_slot(0, None)
