"""grad_path: the RL step along book-keeping, bounded and two-pass paths, and auto's choice by memory."""
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import test_learner as TL
from benchmarks.common import oracle
from conftest import skip_if_not_enough_devices
from vcpo_jax.learner import grad_norms as G
from vcpo_jax.learner import grad_path as GP
from vcpo_jax.learner import config as LC
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import sharding
from vcpo_jax.parallel import target


@pytest.mark.slow
def test_bounded_step_matches_float64_oracle():
  """Golden value as test_learner's, along the bounded path: float32 step vs micro-batch-1 float64 oracle."""
  state, metrics = TL._run(LC.LearnerConfig(grad_path="bounded"))
  batch, params = TL._batch(), TL._params()
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
    g64, stats = jax.jit(functools.partial(oracle.oracle_grads, cfg=TL.CFG, group_size=TL.N, tau=8.0,
                                           is_weight="raw", norm_by_std=True))(
        p64, tokens_BxT=batch.tokens_BxT, mask_BxT=batch.mask_BxT, sampler_logp_BxT=batch.sampler_logp_BxT,
        rewards_B=batch.rewards_B)
    g64, stats = jax.tree.map(np.asarray, g64), jax.tree.map(np.asarray, stats)
  rho = TL._np_ess_ratio(stats["logw_B"])
  np.testing.assert_allclose(metrics["hist/seq_grad_norm_B"], np.sqrt(stats["sq_norms_B"]), rtol=1e-5)
  np.testing.assert_allclose(metrics["baseline"], stats["baseline_B"].mean(), rtol=1e-5, atol=1e-6)
  delta = jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64), state.params, params)
  want = jax.tree.map(lambda g: -TL.LR * np.sqrt(min(rho, 1.0)) * g, g64)
  TL._assert_tree_close(delta, want, 1e-5, "param delta")


# Two scanned layers, GQA, remat; 8 fake devices with fsdp and tensor axes; micro-batches of one group.
SCAN_CFG = dataclasses.replace(TL.CFG, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, scan_layers=True,
                               remat="full")


@pytest.mark.slow
@skip_if_not_enough_devices(8)
def test_paths_agree_on_a_mesh_with_scan_remat_and_micro_batches():
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, tensor=4))  # rows over the 2 fsdp shards
  opt = TL._sgd_ess()
  # Groups of two, so that a chunk of 4 rows over 2 row shards holds one whole group per shard.
  batch = TL._batch().replace(group_B=np.repeat(np.arange(TL.B // 2), 2).astype(np.int32))
  out = {}
  for path in ("book_keeping", "bounded", "two_pass"):
    lc = LC.LearnerConfig(grad_path=path, micro_batch_size=4)
    state = train_state.create_train_state(SCAN_CFG, opt, jax.random.PRNGKey(0), mesh=mesh)
    out[path] = Lr.make_rl_step(SCAN_CFG, lc, opt, mesh=mesh)(state, batch)
  (s0, m0) = out["book_keeping"]
  for path in ("bounded", "two_pass"):
    s, m = out[path]
    TL._assert_tree_close(s.params, s0.params, 1e-5, path)
    for key in ("loss", "ess", "baseline", "grad_norm", "entropy"):
      np.testing.assert_allclose(m[key], m0[key], rtol=1e-5, err_msg=f"{path} {key}")
    np.testing.assert_allclose(m["hist/seq_grad_norm_B"], m0["hist/seq_grad_norm_B"], rtol=1e-5)


@pytest.mark.slow
def test_auto_chooses_by_memory_and_logs_why(caplog):
  lc = LC.LearnerConfig()
  assert GP.choose(dataclasses.replace(lc, grad_memory_budget_gb=0.0), TL.CFG, 8, 12)[0] == "bounded"
  assert GP.choose(lc, TL.CFG, 8, 12)[0] == "book_keeping"
  # The 7B shape, one 8k-token row per device: book-keeping's a/g alone are far over the default budget.
  q7 = M.ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                     num_kv_heads=4, head_dim=128, max_seq_len=8192, dtype="bfloat16")
  path, why = GP.choose(lc, q7, rows=8, seq_len=8192, row_shards=8)
  assert path == "bounded" and "1 rows x 8192 tokens" in why
  assert GP.choose(LC.LearnerConfig(kl_beta=0.1), TL.CFG, 8, 12)[0] == "bounded"
  assert GP.choose(LC.LearnerConfig(advantage="grpo", policy_loss="ppo"), TL.CFG, 8, 12)[0] == "plain"
  assert GP.choose(LC.LearnerConfig(grad_path="two_pass"), TL.CFG, 8, 12)[0] == "two_pass"
  with caplog.at_level(logging.INFO):
    state, metrics = TL._run(LC.LearnerConfig(grad_memory_budget_gb=0.0))
  assert "per-sequence gradient path: bounded (book-keeping's a/g" in caplog.text
  want_state, want = TL._run(LC.LearnerConfig(grad_path="book_keeping"))
  TL._assert_tree_close(state.params, want_state.params, 2e-5, "auto=bounded vs book_keeping")
  with pytest.raises(ValueError, match="book_keeping"):
    LC.LearnerConfig(grad_path="book_keeping", kl_beta=0.1)
  with pytest.raises(ValueError, match="grad_memory_budget_gb"):
    LC.LearnerConfig(grad_memory_budget_gb=-1.0)


def test_auto_budget_is_capped_by_the_target_device_memory():
  """The 7B shape at its own rows on a 16-chip TPU v5e slice (one 640-token row per chip): ~4.7 GB of a/g fit the
  configured 16 GB but not a quarter of a 16 GiB chip, so the step takes the bounded path there; an 80 GB GPU
  keeps the configured budget."""
  lc = LC.LearnerConfig()
  q7 = M.ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                     num_kv_heads=4, head_dim=128, max_seq_len=640, dtype="bfloat16")
  assert GP.choose(lc, q7, rows=16, seq_len=640, row_shards=16)[0] == "book_keeping"  # this CPU: no memory limit
  with target.compiling_for(target.Target("tpu", "TPU v5 lite", 16 * 2**30)):
    path, why = GP.choose(lc, q7, rows=16, seq_len=640, row_shards=16)
    assert path == "bounded" and "> 4.29 GB (0.25 of TPU v5 lite's memory 17.2 GB)" in why, why
  with target.compiling_for(target.Target("gpu", "NVIDIA H100 80GB HBM3", 80 * 10**9)):
    assert GP.budget_gb(lc) == (16.0, "algo.grad_memory_budget_gb=16.0")
    assert GP.choose(lc, q7, rows=16, seq_len=640, row_shards=16)[0] == "book_keeping"


def test_bookkeeping_estimate_counts_what_capture_keeps():
  """stored_elements_per_token is exactly the a/g book-keeping's capture returns (the head's terms aside)."""
  cfg = dataclasses.replace(SCAN_CFG, remat="none")
  b, t = 2, 6
  params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))
  tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
  _, _, inputs, out_grads = jax.eval_shape(lambda p, x: G.capture(p, cfg, x, jnp.ones((b, t))), params, tok)
  kept = [v for tree in (inputs, out_grads) for k, v in tree.items() if k not in (G.HEAD, ("embed_outputs",))]
  assert sum(int(np.prod(v.shape)) for v in kept) == GP.stored_elements_per_token(cfg) * b * t


def _off_reference(params, sigma: float, seed: int = 1):
  """params + sigma x (each leaf's std) x N(0, 1): a policy away from its reference, fixed by the seed."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [x + sigma * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
                                      for x, k in zip(leaves, keys)])


@pytest.mark.slow
def test_bounded_takes_any_registered_loss_kl_included():
  """The bounded path pulls the loss's own dloss/dlogp back (no per-sequence coefficient assumed): with the k3
  KL term (per-token, so no book-keeping) its gradient is the two-pass path's.

  The claim is about the gradient, so one plain SGD step is compared (params move by -LR g, nothing
  normalised as in Adam, whose first steps are ~lr sign(g) and turn rounding in near-zero elements into
  lr-sized differences). The policy starts away from its reference (0.3 std per leaf, kl_beta 2) so the KL
  term is a large part of every leaf's gradient: >= 1.5% of each leaf's scale (measured)."""
  opt = optax.sgd(TL.LR)
  moved = _off_reference(TL._params(), 0.3)
  out = {}
  for path in ("two_pass", "bounded"):
    step = Lr.make_rl_step(TL.CFG, LC.LearnerConfig(kl_beta=2.0, grad_path=path), opt)
    state = train_state.with_reference(train_state.create_train_state(TL.CFG, opt, jax.random.PRNGKey(0)))
    out[path] = step(state.replace(params=jax.tree.map(jnp.copy, moved)), TL._batch())  # the step donates
  (s0, m0), (s1, m1) = out["two_pass"], out["bounded"]
  assert float(m0["kl/mean"]) > 1e-4
  # Scalars, each a float32 reduction of <= ~4e3 terms (tokens, parameters) without cancellation:
  # u sqrt(n) ~ 4e-6 with u = 2^-24; 1e-5 leaves a margin of 2.5.
  for key in ("loss", "kl/mean", "baseline", "grad_norm", "seq_grad_norm/p50"):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, err_msg=key)
  # Each path sums a gradient element over the B*T token terms in its own order: GRAD_TOL (4.7e-6) of each
  # leaf's scale (measured <= 3e-7 with AVX-512, AVX2 and SSE4.2 code). A KL term dropped, or off by 0.1%,
  # moves some leaf by >= 1.5e-5: fails.
  delta = lambda s: jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64), s, moved)
  TL._assert_tree_close(delta(s1.params), delta(s0.params), TL.GRAD_TOL, "kl bounded vs two_pass step")
