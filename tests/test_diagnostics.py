"""Mismatch metrics against a float64 numpy reference, row by row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.algo import diagnostics
from vcpo_jax.learner import config as learner_config
from vcpo_jax.learner import train_state
from vcpo_jax.model import config as model_config


def _reference(logp, sampler, mask, lag, valid):
  out = {}
  delta = (logp.astype(np.float64) - sampler) * mask
  for name, rows in (("lag0", (valid > 0) & (lag == 0)), ("lagged", (valid > 0) & (lag > 0))):
    rows = rows & (mask.sum(1) > 0)
    toks = np.abs(delta[rows])[mask[rows] > 0]
    seqs = delta[rows].sum(1)
    out[f"mismatch/{name}/token_abs_mean"] = toks.mean() if toks.size else 0.0
    out[f"mismatch/{name}/token_abs_max"] = toks.max() if toks.size else 0.0
    out[f"mismatch/{name}/seq_logw_mean"] = seqs.mean() if seqs.size else 0.0
    out[f"mismatch/{name}/seq_logw_abs_mean"] = np.abs(seqs).mean() if seqs.size else 0.0
    out[f"mismatch/{name}/num_seqs"] = float(rows.sum())
  return out


def _batch(seed, b=12, t=20):
  rng = np.random.default_rng(seed)
  logp = -rng.exponential(1.0, (b, t))
  sampler = logp + rng.normal(0, 0.01, (b, t))
  lag = rng.integers(0, 3, b)
  sampler[lag > 0] += rng.normal(0, 0.3, (int((lag > 0).sum()), t))  # lagged rows drift much more
  mask = (rng.random((b, t)) < 0.7).astype(np.float64)
  mask[0] = 0.0  # an empty row counts nowhere
  valid = np.ones(b)
  valid[-1] = 0.0  # a padding row counts nowhere
  return logp, sampler, mask, lag, valid


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mismatch_metrics_match_float64_reference(seed):
  logp, sampler, mask, lag, valid = _batch(seed)
  got = jax.jit(diagnostics.mismatch_metrics)(*(jnp.asarray(x, jnp.float32) for x in (logp, sampler, mask)),
                                              jnp.asarray(lag, jnp.float32), jnp.asarray(valid, jnp.float32))
  want = _reference(logp, sampler, mask, lag, valid)
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_allclose(float(got[key]), want[key], rtol=1e-4, atol=1e-6, err_msg=key)
  # The point of the split: pure mismatch (lag 0) is far smaller than lag + mismatch.
  assert got["mismatch/lag0/token_abs_mean"] < 0.1 * got["mismatch/lagged/token_abs_mean"]


def test_mismatch_metrics_without_lagged_rows_are_zero_with_zero_count():
  logp, sampler, mask, _, valid = _batch(3)
  lag = np.zeros(len(valid))
  got = diagnostics.mismatch_metrics(logp, sampler, mask, lag, valid)
  assert float(got["mismatch/lagged/num_seqs"]) == 0.0 and float(got["mismatch/lagged/seq_logw_mean"]) == 0.0
  assert float(got["mismatch/lag0/num_seqs"]) == valid.sum() - 1  # minus the empty row
  assert np.isfinite([float(v) for v in got.values()]).all()


@pytest.mark.slow
@pytest.mark.parametrize("lc_kwargs", [{}, {"micro_batch_size": 4}, {"advantage": "grpo", "policy_loss": "ppo"}])
def test_learner_step_reports_mismatch_apart_from_lag(lc_kwargs):
  """In the job's metrics: lag-0 rows scored by the sampler with the learner's own weights show ~0, lagged
  rows show exactly their perturbation (bookkeeping, micro-batched and plain autodiff paths)."""
  from vcpo_jax.learner import optimizer
  from vcpo_jax.learner import step as learner
  from vcpo_jax.learner.batch import RLBatch
  from vcpo_jax.model import transformer as model
  cfg = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8, max_seq_len=16)
  b, t = 8, 12
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, cfg.vocab_size, (b, t)).astype(np.int32)
  mask = np.zeros((b, t), np.float32)
  mask[:, 4:4 + 6] = 1.0
  opt = optimizer.build_optimizer(learning_rate=1e-3)
  state = train_state.create_train_state(cfg, opt, jax.random.PRNGKey(0))
  logp = np.asarray(model.token_logprobs(state.params, cfg, jnp.asarray(tokens), jnp.asarray(mask)))
  lag = np.array([0, 1, 0, 2, 0, 1, 0, 1], np.float32)
  shift = rng.normal(0.0, 0.2, (b, t)).astype(np.float32) * mask * (lag > 0)[:, None]
  batch = RLBatch(tokens_BxT=tokens, mask_BxT=mask, sampler_logp_BxT=(logp - shift) * mask,
                  rewards_B=rng.integers(0, 2, b).astype(np.float32), group_B=np.repeat(np.arange(2), 4),
                  lag_B=lag, valid_B=np.ones(b, np.float32))
  step = learner.make_rl_step(cfg, learner_config.LearnerConfig(**lc_kwargs), opt)
  _, metrics = step(state, batch)
  metrics = jax.device_get(metrics)
  assert metrics["mismatch/lag0/token_abs_mean"] < 1e-6 and metrics["mismatch/lag0/num_seqs"] == 4
  lagged = (lag > 0)
  np.testing.assert_allclose(metrics["mismatch/lagged/token_abs_mean"],
                             np.abs(shift[lagged]).sum() / mask[lagged].sum(), rtol=1e-4)
  np.testing.assert_allclose(metrics["mismatch/lagged/seq_logw_mean"], shift[lagged].sum(1).mean(), rtol=1e-4,
                             atol=1e-6)
