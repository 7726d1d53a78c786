"""KL to the frozen warm-start policy: reference log-probs computed inside the learner step; a 3-step job."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import tiny
from vcpo_jax.job import train
from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from tests import model_jit

from test_learner import CFG, GRAD_TOL, LR, _assert_tree_close, _batch


def _logp(params, batch):
  return np.asarray(model_jit.token_logprobs(params, CFG, jnp.asarray(batch.tokens_BxT), jnp.asarray(batch.mask_BxT)),
                    np.float64)


@pytest.mark.slow
def test_kl_step_uses_the_frozen_reference_inside_the_step():
  lc = learner_config.LearnerConfig(kl_beta=0.5)   # OPOB + vcpo: the KL term forces the two-pass gradient path
  assert not lc.uses_bookkeeping
  opt = O.build_optimizer(learning_rate=3e-2, ess_scaling=False)
  step = Lr.make_rl_step(CFG, lc, opt)
  batch = _batch()
  state = train_state.with_reference(train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0)))
  ref = jax.tree.map(np.array, state.ref_params)
  state, m1 = step(state, batch)
  assert abs(float(m1["kl/mean"])) < 1e-6        # the policy starts at its reference
  before = jax.tree.map(np.array, state)      # the step donates its state
  params1 = before.params
  state, m2 = step(state, batch)
  # k3 = r - log r - 1 with r = pi_ref / pi, token mean over the response mask, against float64 numpy.
  log_r = _logp(ref, batch) - _logp(params1, batch)
  mask = batch.mask_BxT.astype(np.float64)
  want = ((np.exp(log_r) - log_r - 1) * mask).sum() / mask.sum()
  assert want > 1e-6
  np.testing.assert_allclose(float(m2["kl/mean"]), want, rtol=1e-3)
  for got, frozen in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(got), frozen)
  # Handing the reference's log-probs in the batch gives the same gradient as computing them in the step: one
  # plain SGD step from params1 each way (params move by -LR g; Adam's second step would divide by sqrt(v) and
  # magnify rounding in near-zero gradient elements into lr-sized differences).
  sgd = optax.sgd(LR)
  sgd_step = Lr.make_rl_step(CFG, lc, sgd)
  start = lambda ref_params: train_state.create_train_state(CFG, sgd, jax.random.PRNGKey(0)).replace(
      params=jax.tree.map(jnp.asarray, params1), ref_params=ref_params)
  computed, m_computed = sgd_step(start(jax.tree.map(jnp.asarray, ref)), batch)
  given, m_given = sgd_step(start(None), batch.replace(ref_logp_BxT=_logp(ref, batch).astype(np.float32)))
  # A scalar reduction of B*T terms: u sqrt(B*T) ~ 6e-7 (u = 2^-24); 1e-5 leaves room for the log-probs' own
  # rounding (the step's forward vs this one, compiled apart), which k3 ~ log_r^2 / 2 doubles.
  np.testing.assert_allclose(float(m_given["kl/mean"]), float(m_computed["kl/mean"]), rtol=1e-5)
  # The two differ only by the reference log-probs' float32 rounding (a relative u per token), which the
  # gradient sums over B*T tokens: GRAD_TOL of each leaf's scale (test_learner).
  delta = lambda s: jax.tree.map(lambda a, p: np.asarray(a, np.float64) - np.asarray(p, np.float64), s.params,
                                 params1)
  _assert_tree_close(delta(given), delta(computed), GRAD_TOL, "given vs computed ref")


def test_kl_without_a_reference_is_an_error_naming_it():
  opt = O.build_optimizer(learning_rate=1e-3, ess_scaling=False)
  step = Lr.make_rl_step(CFG, learner_config.LearnerConfig(kl_beta=0.1), opt)
  with pytest.raises(ValueError, match="ref_params"):
    step(train_state.create_train_state(CFG, opt, jax.random.PRNGKey(0)), _batch())


@pytest.mark.slow
def test_three_step_job_with_kl(tmp_path):
  config = tiny.get_config("emulate")
  config.algo.kl_beta = 0.1
  result = train.train_and_evaluate(config, str(tmp_path))
  assert result["steps"] == 3
  with open(tmp_path / "metrics.jsonl") as f:
    kl = [json.loads(line)["kl/mean"] for line in f if line.strip()]
  assert len(kl) == 3 and all(np.isfinite(kl)) and all(k >= 0 for k in kl)
  assert kl[0] < 1e-6 and kl[-1] > 0      # starts at the reference, then moves away from it
  # The reference is part of the checkpointed state: a rerun restores it and does nothing more.
  assert train.train_and_evaluate(config, str(tmp_path))["steps"] == 3
