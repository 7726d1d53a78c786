"""experiments.studies.horizon.variance: exact per-sequence scores, the estimator's moments, OPOB's second-moment minimum, e2e."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from experiments.studies.horizon import estimator_moments as em
from experiments.studies.horizon import variance
from tests import tiny_runs
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M

CFG = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                               num_kv_heads=1, head_dim=8, max_seq_len=32)


def test_per_sequence_scores_equal_single_sequence_grads():
  """vmap of grad (chunked, padded with an empty row) vs jax.grad of one row's term of the batched log-probs. The
  model computes in float32 only (no float64 dtype), and the two differ in reduction order: elementwise they
  agree to float32 rounding, |diff| <= 1e-6 x max|g| (measured ~2e-7), and their norms to 1e-5."""
  T = 12
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, (2, T)).astype(np.int32)
  mask = np.zeros((2, T), np.float32)
  mask[0, 3:9], mask[1, 2:5] = 1, 1  # unequal lengths 6 and 3, different prompt lengths
  params = jax.jit(functools.partial(M.init_params, CFG))(jax.random.PRNGKey(0))
  S = np.asarray(em.per_sequence_scores(params, CFG, tokens, mask, chunk=3))
  assert S.shape == (2, ravel_pytree(params)[0].size)
  for i in range(2):
    def row_mean_logp(p, i=i):
      logp_BxT = M.token_logprobs(p, CFG, jnp.asarray(tokens), jnp.asarray(mask))
      return jnp.sum(logp_BxT[i] * mask[i]) / mask[i].sum()
    # jitted: op by op, each op of the backward pass is a compile of its own (the test 15.1 s -> 6.7 s)
    want = np.asarray(ravel_pytree(jax.jit(jax.grad(row_mean_logp))(params))[0], np.float64)
    assert np.count_nonzero(want) > want.size // 2  # every layer contributes, not a trivially zero gradient
    np.testing.assert_allclose(S[i], want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert np.linalg.norm(S[i]) == pytest.approx(np.linalg.norm(want), rel=1e-5)
  assert abs(S[0] @ S[1]) > 1e-3 * np.linalg.norm(S[0]) * np.linalg.norm(S[1])  # rows differ: not one vector twice
  S64 = S.astype(np.float64)
  np.testing.assert_allclose(em.gram(jnp.asarray(S)), S64 @ S64.T, rtol=1e-5)


def _random_batch(seed=0, groups=4, n=8, p=40):
  rng = np.random.default_rng(seed)
  b = groups * n
  S = rng.standard_normal((b, p)) * rng.uniform(0.2, 3.0, (b, 1))  # unequal norms: W is not uniform
  rewards = rng.integers(0, 2, b).astype(np.float64) + 0.1 * rng.standard_normal(b)
  logw = 1.5 * rng.standard_normal(b)  # some above log(8): truncated
  lengths = rng.integers(1, 30, b).astype(np.float64)
  group = np.repeat(np.arange(groups), n)
  return S, rewards, logw, lengths, group


def test_moments_equal_direct_sums_over_explicit_vectors():
  S, rewards, *_ = _random_batch()
  c = rewards - 0.4
  x = c[:, None] * S
  got = em.moments(S @ S.T, c)
  assert got["second_moment"] == pytest.approx(np.mean(np.sum(x ** 2, 1)), rel=1e-12)
  assert got["mean_grad_sq"] == pytest.approx(np.sum(x.mean(0) ** 2), rel=1e-12)
  assert got["trace_cov"] == pytest.approx(np.mean(np.sum((x - x.mean(0)) ** 2, 1)), rel=1e-10)


OPOB = dict(scope="group", is_weight="reference", normalize_by_length=False, aggregation="mean", norm_by_std=True,
            winsor_quantiles=(0.05, 0.95))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matched_opob_is_the_per_group_minimiser_of_the_second_moment(seed):
  """OPOB with W = v^2 ||s||^2 (v the estimator's own weight) minimises sum_i ||v_i (R_i - b) s_i||^2 over
  constant b per group (float64 numpy grid), so its batch second moment is the lowest of every baseline's, in the
  unnormalised form, and in the std-normalised one among the baselines divided by that same std (a per-group
  scale does not move the argmin)."""
  S, rewards, logw, lengths, group = _random_batch(seed)
  G = S @ S.T
  sq = np.diag(G)
  advs = em.advantages(rewards, group, lengths, sq, logw, tau=8.0, opob_options=OPOB)
  for weight, v in (("no_is", np.ones_like(logw)), ("tis", np.minimum(np.exp(logw), 8.0))):
    b_B = rewards - advs[("unnormalised", weight, "opob_matched")]
    for g in np.unique(group):
      at = group == g
      W = v[at] ** 2 * sq[at]
      np.testing.assert_allclose(b_B[at], np.sum(W * rewards[at]) / np.sum(W), rtol=1e-5, atol=1e-6)  # float32 OPOB
      f = lambda b: np.sum(W * (rewards[at] - b) ** 2)  # noqa: E731
      grid = np.linspace(rewards[at].min() - 1, rewards[at].max() + 1, 2001)
      assert f(b_B[at][0]) <= min(f(b) for b in grid) * (1 + 1e-6)
    for form in em.FORMS:
      best = em.moments(G, v * advs[(form, weight, "opob_matched")])["second_moment"]
      # normalised: only the baselines scaled by the same per-group std (none is unscaled, GRPO's std is unbiased)
      for baseline in em.BASELINES if form == "unnormalised" else ("group_mean", "opob_raw", "opob_reference",
                                                                       "opob_truncated"):
        if (form, weight, baseline) in advs:
          other = em.moments(G, v * advs[(form, weight, baseline)])["second_moment"]
          assert best <= other * (1 + 1e-5), (form, weight, baseline)


def test_opob_with_another_weight_need_not_minimise():
  """OPOB's reference W (wt^2 w^2 ||grad sum log pi||^2) under the TIS estimator: not the minimiser here."""
  S, rewards, logw, lengths, group = _random_batch(3)
  G = S @ S.T
  advs = em.advantages(rewards, group, lengths, np.diag(G), logw, tau=8.0, opob_options=OPOB)
  v = np.minimum(np.exp(logw), 8.0)
  m2 = {b: em.moments(G, v * advs[("unnormalised", "tis", b)])["second_moment"]
        for b in ("opob_matched", "opob_reference", "group_mean")}
  assert m2["opob_reference"] > m2["opob_matched"] * 1.01


def test_batch_means_and_the_cross_batch_signal():
  rng = np.random.default_rng(0)
  S_BxP = rng.normal(size=(6, 5)).astype(np.float32)
  c = {"a/b/group_mean": rng.normal(size=6), "a/b/x": rng.normal(size=6)}
  g = em.batch_means(jnp.asarray(S_BxP), c)
  np.testing.assert_allclose(g["a/b/x"], S_BxP.T.astype(np.float64) @ c["a/b/x"] / 6, rtol=1e-5)
  # two batches: the signal is exactly <g_0, g_1>; the cosine of a row with itself is 1
  two = [{"r": np.array([1.0, 2.0]), "q": np.array([0.0, 1.0])}, {"r": np.array([3.0, 0.0]), "q": np.array([1.0, 1.0])}]
  out = em.cross_batch(two, lambda row: "q")
  assert out["r"]["signal"] == pytest.approx(3.0) and out["q"]["cos_ref"] == pytest.approx(1.0)
  assert out["r"]["dot_ref"] == pytest.approx((1 * 1 + 2 * 1 + 3 * 0 + 0 * 1) / 2)  # <g0_r, g1_q>, <g1_r, g0_q>
  assert em.cross_batch(two[:1], lambda row: "q") == {}
  # many noisy batches: the noise term drops out (a batch's own ||g||^2 would add tr Cov / B = 40 x 0.25)
  mu, ref = np.full(40, 0.1), np.concatenate([np.full(20, 0.1), np.zeros(20)])
  noisy = [{"r": mu + rng.normal(scale=0.5, size=40), "q": ref + rng.normal(scale=0.5, size=40)} for _ in range(400)]
  out = em.cross_batch(noisy, lambda row: "q")
  assert out["r"]["signal"] == pytest.approx(0.4, abs=0.05)
  assert 0.005 < out["r"]["signal_se"] < 0.05 and np.isnan(em.cross_batch(two, lambda row: "q")["r"]["signal_se"])
  assert out["r"]["cos_ref"] == pytest.approx(0.2 / np.sqrt(0.4 * 0.2), abs=0.1)


@pytest.mark.slow
def test_tool_runs_end_to_end_on_a_tiny_emulated_workdir(tmp_path, monkeypatch):
  """The tool on a tiny run's checkpoint (built in process): tables, plot, json; a clear error once a sampler
  version is gone from the ring. A random model scores 0 on Countdown, so the reward is the completion's length
  parity here (groups with reward variance: every baseline differs)."""
  workdir, out = str(tmp_path / "run"), str(tmp_path / "out")
  tiny_runs.emulated_checkpoint(workdir)
  load_run = variance.load_run

  def parity_rewards(w):
    run = load_run(w)
    run.task.reward_function = lambda: (lambda example, text: float(len(text) % 2))
    return run
  monkeypatch.setattr(variance, "load_run", parity_rewards)
  variance.main([f"--workdir={workdir}", "--batches=2", f"--out={out}", "--chunk=4"])
  results = json.load(open(os.path.join(out, "variance.json")))
  summary = results["steps"]["3"]["summary"]
  assert 0.0 < summary["ess_ratio"] < 1.0 and summary["mean_lag"] == 2.0
  rows = summary["rows"]
  assert len(rows) == len(em.FORMS) * len(em.WEIGHTS) * len(em.BASELINES) - len(em.WEIGHTS)
  assert rows["normalised/tis/group_mean"]["second_moment_rel"] == pytest.approx(1.0)
  for weight in em.WEIGHTS:  # the matched baseline is the minimiser on real scores too
    for b in ("none", "group_mean", "opob_raw", "opob_reference", "opob_truncated"):
      assert rows[f"unnormalised/{weight}/opob_matched"]["second_moment"] <= \
          rows[f"unnormalised/{weight}/{b}"]["second_moment"] * (1 + 1e-5)
  # Two batches of a random model: a signal estimate may be negative (noise larger than the signal), and then
  # its relative values and cosine are NaN rather than a number.
  for key, row in rows.items():
    ref = rows[variance.group_mean_row(key)]
    assert np.isfinite(row["signal"])
    if row["signal"] > 0 and ref["signal"] > 0:
      assert -1.0 - 1e-6 <= row["cos_ref"] <= 1.0 + 1e-6
      assert row["signal_rel"] == pytest.approx(row["signal"] / ref["signal"])
    else:
      assert np.isnan(row["cos_ref"])
    if key.endswith("group_mean") and row["signal"] > 0:
      assert row["signal_rel"] == pytest.approx(1.0) and row["snr_rel"] == pytest.approx(1.0)
  md = open(os.path.join(out, "variance.md")).read()
  assert "| opob_matched | tis |" in md and "s=3 2nd moment" in md and "**normalised: signal**" in md
  assert os.path.getsize(os.path.join(out, "variance.png")) > 0
  os.remove(os.path.join(workdir, "emulation_ring", "v1.npz"))
  with pytest.raises(LookupError, match=r"version\(s\) \[1\]"):
    variance.main([f"--workdir={workdir}", "--steps=3", "--batches=1", f"--out={out}"])
