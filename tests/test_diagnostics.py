"""Mismatch metrics against a float64 numpy reference, row by row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax import diagnostics


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
