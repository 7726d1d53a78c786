"""Tool use, learner side: masks with holes (generated | tool output | generated) in the RL step.

Tool-output tokens are context (attended to) but mask 0: no loss, no share of the IS log-weight, the OPOB
per-sequence norms or the length normaliser. The step on such a batch, with garbage sampler log-probs at the
holes, must equal the float64 micro-batch-1 oracle given zeros there.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks.common import oracle
from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import grad_norms as G
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.learner.batch import RLBatch
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M

CFG = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, max_seq_len=32)
B, T, N = 8, 16, 4
LR = 1e3


def _episode_batch():
  """Two groups of four episodes: prompt, then turns and tool outputs of varied lengths, then padding."""
  rng = np.random.default_rng(3)
  tokens = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B):
    pos = 2 + i % 2
    for turn in range(1 + i % 3):  # 1-3 model turns, a tool output of 2-3 tokens after each but the last
      n = 2 + (i + turn) % 2
      mask[i, pos:pos + n] = 1
      pos += n + (2 + turn % 2 if turn < i % 3 else 0)
    tokens[i, pos:] = 0
  holes = np.zeros_like(mask, bool)
  for i in range(B):
    gen = np.flatnonzero(mask[i])
    holes[i, gen[0]:gen[-1]] = mask[i, gen[0]:gen[-1]] == 0
  assert holes[2].any() and holes[4].any() and not holes[0].any()
  sampler = (-3.7 + 0.4 * rng.standard_normal((B, T))).astype(np.float32) * mask
  rewards = np.array([1, 0, 1, 1, 0, 1, 0, 0], np.float32)
  batch = RLBatch(tokens_BxT=tokens, mask_BxT=mask, sampler_logp_BxT=sampler, rewards_B=rewards,
                  group_B=np.repeat(np.arange(B // N), N).astype(np.int32), lag_B=np.ones(B, np.float32),
                  valid_B=np.ones(B, np.float32))
  return batch, holes


@functools.lru_cache(maxsize=None)
def _params():
  return jax.jit(functools.partial(M.init_params, CFG))(jax.random.PRNGKey(0))


@pytest.mark.slow  # one RL-step compile and a float64 oracle: ~2.5 min on the loaded 2-core machine
def test_rl_step_with_tool_holes_matches_the_oracle():
  batch, holes = _episode_batch()
  garbage = np.where(holes, np.float32(np.nan), batch.sampler_logp_BxT)
  garbage[0, -1] = 1e30  # padding position too
  opt = optax.chain(optax.sgd(LR), O.scale_by_ess(base_ess_ratio=1.0, rule="sqrt"))
  state = train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0))
  params = jax.device_get(state.params)  # the step donates the state's buffers
  new_state, metrics = Lr.make_rl_step(CFG, learner_config.LearnerConfig(), opt)(state, batch.replace(sampler_logp_BxT=garbage))
  assert int(metrics.get("skipped", 0)) == 0
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
    g64, stats = jax.jit(functools.partial(oracle.oracle_grads, cfg=CFG, group_size=N, tau=8.0, is_weight="raw",
                                           norm_by_std=True))(
        p64, tokens_BxT=batch.tokens_BxT, mask_BxT=batch.mask_BxT, sampler_logp_BxT=batch.sampler_logp_BxT,
        rewards_B=batch.rewards_B)
    g64, stats = jax.tree.map(np.asarray, g64), jax.tree.map(np.asarray, stats)
  w = np.exp(stats["logw_B"] - stats["logw_B"].max())
  rho = w.sum() ** 2 / (w ** 2).sum() / B
  np.testing.assert_allclose(metrics["ess_ratio"], rho, rtol=1e-5)
  np.testing.assert_allclose(metrics["baseline"], stats["baseline_B"].mean(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["hist/seq_grad_norm_B"], np.sqrt(stats["sq_norms_B"]), rtol=1e-5)
  np.testing.assert_allclose(metrics["response_length/mean"] if "response_length/mean" in metrics else
                             batch.mask_BxT.sum(1).mean(), batch.mask_BxT.sum(1).mean())
  scale = np.sqrt(min(rho, 1.0))
  for (path, got), p, g in zip(jax.tree_util.tree_leaves_with_path(new_state.params), jax.tree.leaves(params),
                               jax.tree.leaves(g64)):
    delta, want = np.asarray(got, np.float64) - np.asarray(p, np.float64), -LR * scale * g
    top = max(np.max(np.abs(want)), 1e-12)
    np.testing.assert_allclose(delta / top, want / top, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # two compiles, ~2 min on the loaded 2-core machine
def test_tool_tokens_are_context_not_targets():
  """A hole's tokens change the later generated tokens' log-probs (attended to) but get no gradient score."""
  batch, holes = _episode_batch()
  params = _params()
  logp = jax.jit(functools.partial(M.token_logprobs, cfg=CFG))
  row = 2
  hole_pos = np.flatnonzero(holes[row])
  other = batch.tokens_BxT.copy()
  other[row, hole_pos] = (other[row, hole_pos] + 7) % CFG.vocab_size
  a = np.asarray(logp(params, tokens_BxT=batch.tokens_BxT, mask_BxT=batch.mask_BxT))[row]
  b = np.asarray(logp(params, tokens_BxT=other, mask_BxT=batch.mask_BxT))[row]
  assert np.all(a[holes[row]] == 0) and np.all(b[holes[row]] == 0)
  after = np.arange(T) > hole_pos[-1]
  assert np.any(np.abs(a - b)[after & (batch.mask_BxT[row] > 0)] > 1e-4)  # later turns see the tool output
  sq_a, _ = jax.jit(functools.partial(G.per_sequence_sq_norms, cfg=CFG))(
      params, tokens_BxT=batch.tokens_BxT, mask_BxT=batch.mask_BxT)
  only_before = batch.mask_BxT * (np.arange(T)[None, :] < hole_pos[0])
  sq_b, _ = jax.jit(functools.partial(G.per_sequence_sq_norms, cfg=CFG))(
      params, tokens_BxT=batch.tokens_BxT, mask_BxT=only_before)
  assert float(sq_b[row]) < float(sq_a[row])  # the turn after the hole contributes to the norm
