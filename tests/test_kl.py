"""KL to the frozen warm-start policy: reference log-probs computed inside the learner step; a 3-step job."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from vcpo_jax.job import train
from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import optimizer as O
from vcpo_jax.learner import step as Lr
from vcpo_jax.learner import train_state
from vcpo_jax.model import transformer as M

from test_learner import CFG, _batch


def _logp(params, batch):
  return np.asarray(M.token_logprobs(params, CFG, jnp.asarray(batch.tokens_BxT), jnp.asarray(batch.mask_BxT)),
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
  # Handing the reference's log-probs in the batch gives the same update as computing them in the step.
  given = jax.tree.map(jnp.asarray, before.replace(ref_params=None))
  given, m_given = step(given, batch.replace(ref_logp_BxT=_logp(ref, batch).astype(np.float32)))
  np.testing.assert_allclose(float(m_given["kl/mean"]), float(m2["kl/mean"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(given.params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


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
