"""LoRA in the learner: per-sequence norms over the adapter vs vmap(grad), adapter-only updates and optimizer
state, the base as KL reference, sharding and checkpoints."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from conftest import skip_if_not_enough_devices
from vcpo_jax.job import checkpointing
from vcpo_jax.learner import bounded_norms as BN
from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import grad_norms as G
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.learner.batch import RLBatch
from vcpo_jax.model import config as C
from vcpo_jax.model import lora
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import sharding

B, T, N = 8, 12, 4
LORA = C.LoraConfig(rank=3, alpha=6.0)


def _cfg(scan=False, targets=C.LINEAR_MODULES):
  return C.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=8, max_seq_len=32, scan_layers=scan,
                       lora=dataclasses.replace(LORA, target_modules=targets))


@functools.lru_cache(maxsize=None)
def _setup(scan=False, targets=C.LINEAR_MODULES):
  cfg = _cfg(scan, targets)
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  keys = iter(jax.random.split(jax.random.PRNGKey(5), 100))
  adapter = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape),
                         lora.init_adapter(jax.random.PRNGKey(1), cfg))
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 40, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B):
    mask[i, 2 + i % 3: min(T, 4 + i % 3 + (3 * i) % 7)] = 1
  mask[3] = 0  # an empty response: norm 0
  return cfg, params, adapter, jnp.asarray(tokens), jnp.asarray(mask)


def _brute_sq(cfg, params, adapter, tokens, mask):
  """Per-sequence adapter gradients by vmap(grad over the adapter), squared norms summed in float64."""
  def seq_logp(ad, tok_T, m_T):
    return jnp.sum(M.token_logprobs(params, cfg, tok_T[None], m_T[None], adapter=ad))
  per_seq = jax.jit(jax.vmap(jax.grad(seq_logp), in_axes=(None, 0, 0)))(adapter, tokens, mask)
  leaf = {"/".join(k): np.sum(np.square(np.asarray(v, np.float64).reshape(B, -1)), axis=1)
          for k, v in traverse_util.flatten_dict(per_seq).items()}
  return sum(leaf.values()), leaf


@pytest.mark.parametrize("scan,targets", [(False, C.LINEAR_MODULES), (True, C.LINEAR_MODULES),
                                          (False, ("k_proj", "o_proj", "up_proj"))])
@pytest.mark.parametrize("path", ["book_keeping", "bounded"])
@pytest.mark.slow
def test_per_sequence_norms_are_the_adapters(scan, targets, path):
  cfg, params, adapter, tokens, mask = _setup(scan, targets)
  want, want_leaf = _brute_sq(cfg, params, adapter, tokens, mask)
  fn = G.per_sequence_sq_norms if path == "book_keeping" else BN.per_sequence_sq_norms
  sq_B, aux = jax.jit(lambda p, a: fn(p, cfg, tokens, mask, adapter=a))(params, adapter)
  assert set(aux["leaf_sq_norms"]) == set(want_leaf)  # the adapter's leaves only: the base is frozen
  for k, v in want_leaf.items():
    np.testing.assert_allclose(np.asarray(aux["leaf_sq_norms"][k], np.float64), v, rtol=2e-4,
                               atol=1e-6 * max(v.max(), 1e-6), err_msg=k)
  np.testing.assert_allclose(np.asarray(sq_B, np.float64), want, rtol=2e-4)
  assert want[3] == 0 and want.min() < want.max()
  # ... and the base's own norms are something else entirely (the adapter's are not the model's).
  full_sq, _ = jax.jit(lambda p: G.per_sequence_sq_norms(p, cfg, tokens, mask))(lora.merge(params, adapter, cfg))
  assert not np.allclose(np.asarray(full_sq), want, rtol=0.1)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_weighted_gradient_of_the_adapter_matches_autodiff(scan):
  cfg, params, adapter, tokens, mask = _setup(scan)
  c_B = jnp.linspace(-1.0, 2.0, B)
  coef_fn = lambda sq, logp, ent: (c_B, None)  # noqa: E731
  want = G.weighted_logp_grad(params, cfg, tokens, mask, c_B, adapter=adapter)
  for fn in (G.per_sequence_sq_norms_and_grad, BN.per_sequence_sq_norms_and_grad):
    got, _, _ = jax.jit(lambda p, a, fn=fn: fn(p, cfg, tokens, mask, coef_fn, adapter=a))(params, adapter)
    assert jax.tree.structure(got) == jax.tree.structure(adapter)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * float(jnp.abs(w).max()))


def _batch(cfg):
  rng = np.random.default_rng(1)
  _, _, _, tokens, mask = _setup()
  sampler = (-3.7 + 0.4 * rng.standard_normal((B, T))).astype(np.float32) * np.asarray(mask)
  return RLBatch(tokens_BxT=np.asarray(tokens), mask_BxT=np.asarray(mask), sampler_logp_BxT=sampler,
                 rewards_B=np.array([1, 0, 1, 1, 0, 1, 0, 0], np.float32),
                 group_B=np.repeat(np.arange(B // N), N).astype(np.int32),
                 lag_B=rng.integers(0, 4, B).astype(np.float32), valid_B=np.ones(B, np.float32))


def _lora_state(cfg, opt, params, adapter):
  """A fresh state holding copies of these base params and adapter (the step donates its state)."""
  return train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0)).replace(
      base=jax.tree.map(jnp.copy, params), params=jax.tree.map(jnp.copy, adapter))


def _opt():
  return optax.chain(optax.sgd(1.0), O.scale_by_ess(base_ess_ratio=1.0, rule="sqrt"))


@pytest.mark.slow
def test_state_trains_the_adapter_alone_with_its_own_optimizer_state():
  cfg = _cfg()
  opt = O.build_optimizer(learning_rate=1e-2)
  state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0))
  assert jax.tree.structure(state.params) == jax.tree.structure(lora.init_adapter(jax.random.PRNGKey(0), cfg))
  assert state.ref_params is None and state.base is not None
  adapter_elems = lora.count(state.params)
  opt_elems = sum(int(x.size) for x in jax.tree.leaves(state.opt_state))
  # Adam's two moments of the adapter (+ scalar counters), nothing shaped like a base parameter.
  assert opt_elems <= 2 * adapter_elems + 16 < M.count_params(state.base)
  adapter_shapes = {x.shape for x in jax.tree.leaves(state.params)}
  assert {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim} <= adapter_shapes
  lc = learner_config.LearnerConfig(kl_beta=0.1)
  base_before, adapter_before = jax.tree.map(np.asarray, (state.base, state.params))  # the step donates state
  new, metrics = Lr.make_rl_step(cfg, lc, opt)(train_state.with_reference(state), _batch(cfg))
  assert float(metrics["update_applied"]) == 1.0
  # Step 0: B = 0, so the policy is the base and the KL to the reference (the base, adapter off) is 0.
  assert float(metrics["kl/mean"]) == 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new.base), base_before)
  moved = [float(np.abs(np.asarray(a) - b).max())
           for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(adapter_before))]
  assert max(moved) > 0  # B moved off zero


@pytest.mark.parametrize("advantage,grad_path", [("opob", "book_keeping"), ("opob", "bounded"),
                                                 ("opob", "two_pass"), ("grpo", "auto")])
@pytest.mark.slow
def test_every_gradient_path_takes_the_same_adapter_step(advantage, grad_path):
  cfg, params, adapter, _, _ = _setup()
  opt = _opt()
  state = _lora_state(cfg, opt, params, adapter)
  lc = learner_config.LearnerConfig(advantage=advantage, grad_path=grad_path)
  new, m = Lr.make_rl_step(cfg, lc, opt)(state, _batch(cfg))
  # The reference: plain autodiff of the same loss over the adapter, with the norms by vmap(grad).
  ref_lc = learner_config.LearnerConfig(advantage=advantage, grad_path="two_pass")
  want, wm = Lr.make_rl_step(cfg, ref_lc, opt)(_lora_state(cfg, opt, params, adapter), _batch(cfg))
  for g, w in zip(jax.tree.leaves(new.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
  if advantage == "opob":
    sq, _ = _brute_sq(cfg, params, adapter, jnp.asarray(_batch(cfg).tokens_BxT), jnp.asarray(_batch(cfg).mask_BxT))
    np.testing.assert_allclose(np.asarray(m["hist/seq_grad_norm_B"], np.float64) ** 2, sq, rtol=1e-3)
  np.testing.assert_allclose(m["ess_ratio"], wm["ess_ratio"], rtol=1e-6)


@skip_if_not_enough_devices(8)
@pytest.mark.slow
def test_sharded_state_keeps_the_base_sharded_and_shards_the_adapter():
  cfg = _cfg()
  opt = O.build_optimizer(learning_rate=1e-2)
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0), mesh=mesh)
  full = train_state.create_train_state(dataclasses.replace(cfg, lora=C.LoraConfig()), opt, jax.random.PRNGKey(0),
                                        mesh=mesh)
  assert (jax.tree.map(lambda x: x.sharding.spec, state.base) == jax.tree.map(lambda x: x.sharding.spec,
                                                                              full.params))
  a = state.params["layers_0"]["mlp"]["up_proj"]
  assert a["lora_A"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)  # embed x lora_rank
  assert a["lora_B"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")  # lora_rank x mlp
  new, m = Lr.make_rl_step(cfg, learner_config.LearnerConfig(), opt, mesh=mesh)(state, _batch(cfg))
  assert np.isfinite(float(m["loss"])) and float(m["update_applied"]) == 1.0


def test_checkpoint_restores_adapter_base_and_optimizer_state(tmp_path):
  cfg = _cfg()
  opt = O.build_optimizer(learning_rate=1e-2)
  state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0))
  state, _ = Lr.make_rl_step(cfg, learner_config.LearnerConfig(), opt)(state, _batch(cfg))
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, state, {"step": 1})
  ckpt.close()
  fresh = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(7))
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"))
  step, restored, _ = ckpt.restore(checkpointing.abstract_like(fresh))
  ckpt.close()
  assert step == 1
  for part in ("params", "opt_state", "base"):
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, getattr(restored, part)),
                 jax.tree.map(np.asarray, getattr(state, part)))


def test_policy_params_merge_the_adapter_for_full_weight_consumers():
  cfg, params, adapter, tokens, mask = _setup()
  state = _lora_state(cfg, _opt(), params, adapter)
  merged = train_state.policy_params(state, cfg)
  np.testing.assert_allclose(np.asarray(M.token_logprobs(merged, cfg, tokens, mask)),
                             np.asarray(M.token_logprobs(params, cfg, tokens, mask, adapter=adapter)), atol=1e-5)
  assert train_state.base_params(state) is state.base


@pytest.mark.slow
@pytest.mark.integration
def test_the_tiny_job_trains_lora_against_an_embedded_server_and_resumes(tmp_path):
  """configs/tiny.py with model.lora.rank=4 and a KL term: the async job with its embedded server runs its
  steps, its per-sequence norms are the adapter's, and a rerun restores the LoRA state from the last
  checkpoint and does nothing more. The server keeps the base and gets adapters: v0 (B = 0) at the start,
  then v1..v3 loaded as policy-v1..policy-v3 from small PEFT directories; no full weights are exported."""
  import json
  from configs import tiny
  from vcpo_jax.job import configuration, train

  def config():
    c = tiny.get_config()
    c.model.lora.rank = 4
    c.algo.kl_beta = 0.01  # the reference is the base with the adapter off
    return c
  result = train.train_and_evaluate(config(), str(tmp_path))
  assert result["steps"] == 3
  scalars = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [s["step"] for s in scalars] == [1, 2, 3]
  for s in scalars:
    assert s["update_applied"] == 1.0 and np.isfinite(s["loss"]) and s["seq_grad_norm/max"] > 0
    assert s["lag/max"] <= 1  # tokens tagged by the adapter that made them (a base-tagged v0 would lag more)
  import glob
  import os
  [log] = glob.glob(str(tmp_path / "logs" / "server-*.log"))
  text = open(log).read()
  for v in range(4):  # every version reached the server as an adapter, in order
    assert f"LoRA adapter policy-v{v} loaded" in text
  assert text.index("policy-v0 loaded") < text.index("policy-v1 loaded") < text.index("policy-v3 loaded")
  assert "weights updated from" not in text  # the base was never replaced
  weights = tmp_path / "weights"
  assert [d for d in os.listdir(weights) if d.startswith("v")] == []  # no full-weight export at all
  adapter_dirs = os.listdir(weights / "adapters")
  assert adapter_dirs == ["policy-v3"]  # older ones deleted once unloaded
  size = sum(os.path.getsize(f) for f in glob.glob(str(weights / "adapters" / "policy-v3" / "*")))
  base_size = sum(os.path.getsize(f) for f in glob.glob(str(tmp_path / "base" / "*.safetensors")))
  assert 0 < size < base_size / 5, (size, base_size)
  # The final adapter, as a PEFT directory next to the base it applies to.
  from vcpo_jax.model import peft_export
  model_cfg = configuration.validate_config(config())
  adapter, lora_cfg = peft_export.read_adapter(str(tmp_path / "adapter"), model_cfg)
  assert lora_cfg == model_cfg.lora
  restored = checkpointing.Checkpointer(str(tmp_path / "checkpoints"))
  _, state, _ = restored.restore(checkpointing.abstract_like(
      train_state.create_train_state(model_cfg, configuration.build_optimizer(config()), jax.random.PRNGKey(0))))
  restored.close()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), adapter, state.params)
  again = train.train_and_evaluate(config(), str(tmp_path))
  assert again["steps"] == 3 and len(open(tmp_path / "metrics.jsonl").readlines()) == 3


@pytest.mark.parametrize("targets", [C.LINEAR_MODULES, ("v_proj", "gate_proj")])
def test_bookkeeping_estimate_counts_the_adapters_activations(targets):
  from vcpo_jax.learner import grad_path as GP
  cfg = _cfg(scan=True, targets=targets)
  b, t = 2, 6
  params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))
  adapter = jax.eval_shape(lambda: lora.init_adapter(jax.random.PRNGKey(0), cfg))
  tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
  _, _, inputs, out_grads = jax.eval_shape(lambda p, a, x: G.capture(p, cfg, x, jnp.ones((b, t)), adapter=a),
                                           params, adapter, tok)
  kept = [v for tree in (inputs, out_grads) for k, v in tree.items() if k not in (G.HEAD, ("embed_outputs",))]
  assert sum(int(np.prod(v.shape)) for v in kept) == GP.stored_elements_per_token(cfg) * b * t
  assert GP.stored_elements_per_token(cfg) > GP.stored_elements_per_token(dataclasses.replace(cfg, lora=C.LoraConfig()))


@pytest.mark.slow
def test_micro_batched_lora_step_equals_the_whole_batch():
  cfg, params, adapter, _, _ = _setup()
  opt = _opt()
  whole, wm = Lr.make_rl_step(cfg, learner_config.LearnerConfig(), opt)(_lora_state(cfg, opt, params, adapter),
                                                                       _batch(cfg))
  micro, mm = Lr.make_rl_step(cfg, learner_config.LearnerConfig(micro_batch_size=N), opt)(
      _lora_state(cfg, opt, params, adapter), _batch(cfg))
  for g, w in zip(jax.tree.leaves(micro.params), jax.tree.leaves(whole.params)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
  # OPOB's loss (~0.16 here) is a difference of O(1) terms: float32 noise of the chunked sums (log w differ by
  # 2e-7 between the two) is ~1e-5 of the terms, not of the loss; GRPO's loss agrees to 3e-7.
  np.testing.assert_allclose(mm["loss"], wm["loss"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mm["hist/logw_B"], wm["hist/logw_B"], atol=1e-6)
