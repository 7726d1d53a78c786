"""Advantage estimators (algo/advantages.py) against float64 numpy loops, OPOB and the registry's errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_losses import _j
from vcpo_jax.algo import advantages
from vcpo_jax.algo import losses
from vcpo_jax.algo import vcpo


def _adv_inputs(seed=12):
  rng = np.random.default_rng(seed)
  group = np.repeat(rng.permutation(50)[:4], [4, 4, 3, 1])[rng.permutation(12)]
  rewards = rng.normal(size=12)
  valid = np.ones(12, bool)
  valid[rng.integers(0, 12)] = False
  return group, rewards, valid


def test_group_estimators_match_numpy_loops():
  group, rewards, valid = _adv_inputs()
  inputs = advantages.AdvantageInputs(rewards_B=_j(rewards), group_B=jnp.asarray(group), valid_B=jnp.asarray(valid))
  got = {name: np.asarray(jax.jit(losses.get_advantage_fn(name))(inputs))
         for name in ('grpo', 'dr_grpo', 'rloo', 'reinforce')}
  exp = {k: np.zeros(12) for k in got}
  for i in np.flatnonzero(valid):
    same = (group == group[i]) & valid
    r = rewards[same]
    if r.size > 1:
      exp['grpo'][i] = (rewards[i] - r.mean()) / (r.std(ddof=1) + 1e-6)
      exp['dr_grpo'][i] = rewards[i] - r.mean()
      others = same.copy()
      others[i] = False
      exp['rloo'][i] = rewards[i] - rewards[others].mean()
    else:
      exp['grpo'][i] = rewards[i] / (1 + 1e-6)
      exp['dr_grpo'][i] = exp['rloo'][i] = rewards[i]
    exp['reinforce'][i] = rewards[i] - rewards[valid].mean()
  for name in got:
    np.testing.assert_allclose(got[name], exp[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_opob_estimator_and_registry_errors():
  group, rewards, valid = _adv_inputs(13)
  rng = np.random.default_rng(13)
  logw = _j(rng.normal(size=12))
  wt = vcpo.truncated_weights(logw)
  inputs = advantages.AdvantageInputs(rewards_B=_j(rewards), group_B=jnp.asarray(group), logw_B=logw, wt_B=wt,
                                  lengths_B=_j(rng.integers(1, 9, 12)), sq_norms_B=_j(rng.gamma(2.0, size=12)),
                                  valid_B=jnp.asarray(valid))
  got = losses.get_advantage_fn('opob')(inputs, aggregation='median', is_weight='truncated')
  exp, _ = vcpo.opob_advantages(inputs.rewards_B, inputs.group_B, inputs.sq_norms_B, logw, wt, inputs.lengths_B,
                                aggregation='median', is_weight='truncated', valid_B=inputs.valid_B)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
  assert losses.needs_grad_norms('opob') and not losses.needs_grad_norms('grpo')
  with pytest.raises(ValueError, match='sq_norms_B'):
    losses.get_advantage_fn('opob')(advantages.AdvantageInputs(rewards_B=_j(rewards), group_B=jnp.asarray(group)))
  with pytest.raises(ValueError, match='grpo'):  # the message lists the known names
    losses.get_advantage_fn('ppo')
  with pytest.raises(ValueError, match='aggregation'):
    losses.get_advantage_fn('opob')(inputs, aggregation='max')
  with pytest.raises(ValueError, match='norm_by_sd'):
    losses.get_advantage_fn('grpo')(inputs, norm_by_sd=True)
  with pytest.raises(ValueError, match='vcpo'):
    losses.get_policy_loss('reinforce_plus')
  with pytest.raises(ValueError, match='tau_max'):
    losses.get_policy_loss('vcpo')(_j(np.zeros((2, 3))), _j(np.zeros((2, 3))), _j(np.ones((2, 3))),
                                   _j(np.zeros(2)), tau_max=3.0)
  with pytest.raises(ValueError, match='adv_B'):
    losses.get_policy_loss('vcpo')(_j(np.zeros((2, 3))), _j(np.zeros((2, 3))), _j(np.ones((2, 3))), _j(np.zeros(3)))
  with pytest.raises(ValueError, match='rollout_is'):
    losses.get_policy_loss('gspo')(_j(np.zeros((2, 3))), _j(np.zeros((2, 3))), _j(np.ones((2, 3))),
                                   _j(np.zeros(2)), rollout_is='seq')


@pytest.mark.slow
def test_dr_grpo_step_divides_by_generation_budget():
  """Dr.GRPO's normalizer is a constant: the learner step's 'seq-mean-token-sum-norm' loss is each response's
  token sum / rl.max_new_tokens (the generation budget, via LearnerConfig.generation_budget), never the
  batch's longest response; whole batch and micro-batch chunks alike, against float64 numpy."""
  from vcpo_jax.learner import config as learner_config
  from vcpo_jax.learner import optimizer as optimizer_lib
  from vcpo_jax.learner import step as step_lib
  from vcpo_jax.learner import train_state
  from vcpo_jax.learner.batch import RLBatch
  from vcpo_jax.model import config as model_config
  from tests import model_jit

  cfg = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                                 num_kv_heads=1, head_dim=8, max_seq_len=32)
  rows, width, budget = 8, 12, 16            # every response is shorter than the budget (longest: 6 tokens)
  rng = np.random.default_rng(21)
  tokens_BxT = rng.integers(1, cfg.vocab_size, (rows, width)).astype(np.int32)
  mask_BxT = np.zeros((rows, width), np.float32)
  for i in range(rows - 1):                  # the last row has no response: it is not a sequence of the mean
    mask_BxT[i, 2:2 + 1 + i % 6] = 1
  rewards_B = rng.normal(size=rows).astype(np.float32)
  batch = RLBatch(tokens_BxT=tokens_BxT, mask_BxT=mask_BxT, sampler_logp_BxT=np.full((rows, width), -3.0, np.float32),
                  rewards_B=rewards_B, group_B=np.repeat(np.arange(rows // 4), 4).astype(np.int32),
                  lag_B=np.zeros(rows, np.float32), valid_B=np.ones(rows, np.float32))
  opt = optimizer_lib.build_optimizer(learning_rate=0.0, weight_decay=0.0, ess_scaling=False)
  params = model_jit.init_params(cfg, jax.random.PRNGKey(0))
  logp_BxT = np.asarray(model_jit.token_logprobs(params, cfg, jnp.asarray(tokens_BxT), jnp.asarray(mask_BxT)),
                        np.float64)
  # pg with reinforce advantages (A = R): loss = mean over non-empty rows of -R_i sum_t m_t logp_t / budget.
  seqs = [i for i in range(rows) if mask_BxT[i].sum() > 0]
  want = np.mean([-float(rewards_B[i]) * (logp_BxT[i] * mask_BxT[i]).sum() / budget for i in seqs])
  assert mask_BxT.sum(-1).max() < budget     # the old normalizer (the longest response) would differ
  for micro in (0, 4):
    lc = learner_config.LearnerConfig(advantage="reinforce", advantage_options=dict(baseline=False),
                                      policy_loss="pg", aggregation="seq-mean-token-sum-norm",
                                      generation_budget=budget, micro_batch_size=micro)
    state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0))
    state = train_state.with_params(state, jax.tree.map(jnp.copy, params))  # the step donates the state
    _, metrics = step_lib.make_rl_step(cfg, lc, opt)(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-5, err_msg=f"micro_batch_size={micro}")
  with pytest.raises(ValueError, match="generation_budget"):
    learner_config.LearnerConfig(aggregation="seq-mean-token-sum-norm")
  with pytest.raises(ValueError, match="generation_budget"):
    learner_config.LearnerConfig(aggregation="seq-mean-token-sum-norm", generation_budget=0)
