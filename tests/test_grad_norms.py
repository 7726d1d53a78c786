"""grad_norms: per-sequence norms and the book-keeping weighted gradient vs vmap(grad) and jax.grad."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from vcpo_jax.learner import grad_norms as G
from vcpo_jax.learner import op_norms
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M

B, T = 4, 10


def _cfg(tied: bool) -> model_config.ModelConfig:
  return model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, max_seq_len=32, tie_word_embeddings=tied)


def perturbed_params(cfg):
  """Initial params plus noise, so RMSNorm scales and biases are not at their trivial initial values."""
  @jax.jit
  def init(key):
    params = M.init_params(cfg, key)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  return init(jax.random.PRNGKey(0))


def assert_per_token_close(got, want, what=""):
  """Per-token log-probs (or entropies) along two float32 paths: logits are dots over the hidden size and the
  log-sum-exp sums V terms, each in its own order, so they differ by ~ u (sqrt(D) + sqrt(V)) ~ 10 u of the
  largest |value| (u = 2^-24; these params give |log-prob| up to ~10, where one ulp is 1e-6). 16 u of it;
  a log-prob off by 0.1% is ~60x that."""
  want = np.asarray(want, np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=16 * 2.0**-24 * max(float(np.max(np.abs(want))), 1.0),
                             err_msg=what)


def padded_rows(b: int, t: int):
  """tokens_BxT (few ids: many repeats), response mask_BxT and key_mask_BxT: prompts of unequal length,
  unequal ends, one empty response, pad id 0 after each end."""
  tokens = jax.random.randint(jax.random.PRNGKey(2), (b, t), 0, 7)
  prompt_B, end_B = jnp.array([2, 3, 1, 4]), jnp.array([4, 8, 10, 4])  # last row: empty response
  t_T = jnp.arange(t)
  mask = ((t_T[None, :] >= prompt_B[:, None]) & (t_T[None, :] < end_B[:, None])).astype(jnp.float32)
  key_mask = (t_T[None, :] < end_B[:, None]).astype(jnp.int32)  # padded keys are invisible
  return jnp.where(key_mask > 0, tokens, 0), mask, key_mask


@functools.lru_cache(maxsize=None)
def _setup(tied: bool):
  """Params with non-trivial norms/biases, repeated tokens, prompts and right padding of unequal length."""
  cfg = _cfg(tied)
  tokens, mask, _ = padded_rows(B, T)
  return cfg, perturbed_params(cfg), tokens, mask


@functools.lru_cache(maxsize=None)
def _brute(tied: bool):
  """Per-sequence gradients by vmap(grad) of each row's own summed response log-prob."""
  cfg, params, tokens, mask = _setup(tied)

  def seq_logp(p, tok_T, m_T):
    return jnp.sum(M.token_logprobs(p, cfg, tok_T[None], m_T[None]))

  return jax.jit(jax.vmap(jax.grad(seq_logp), in_axes=(None, 0, 0)))(params, tokens, mask)


@functools.lru_cache(maxsize=None)
def _norms_fn(cfg: model_config.ModelConfig, mode: str = "auto"):
  """One compiled norms function per (config, mode), shared by the tests."""
  return jax.jit(functools.partial(G.per_sequence_sq_norms, cfg=cfg, mode=mode))


def _leaf_sq(per_seq):
  return {"/".join(k): np.sum(np.square(np.asarray(v, np.float64).reshape(B, -1)), axis=1)
          for k, v in traverse_util.flatten_dict(per_seq).items()}


# T=10 < V: 'auto' already mixes ghost (head, embedding) and explicit (small dense) rules; the forced modes
# cover the other branch of each.
@pytest.mark.slow
@pytest.mark.parametrize("tied,mode", [(False, "auto"), (False, "ghost"), (False, "explicit"), (True, "auto")])
def test_norms_match_vmap_grad_per_leaf(tied, mode):
  cfg, params, tokens, mask = _setup(tied)
  want = _leaf_sq(_brute(tied))
  sq_B, aux = _norms_fn(cfg, mode)(params, tokens_BxT=tokens, mask_BxT=mask)
  np.testing.assert_allclose(sq_B[:3], sum(want.values())[:3], rtol=1e-5)
  assert float(sq_B[3]) == 0.0  # empty response has zero score
  # Every parameter leaf has its own entry and matches on its own, so that even the k bias (share ~1e-5 of
  # the total: softmax is nearly shift-invariant in it) cannot hide inside the total's tolerance.
  got = {k: np.asarray(v, np.float64) for k, v in aux["leaf_sq_norms"].items()}
  assert set(got) == set(want) == {"/".join(k) for k in traverse_util.flatten_dict(params)}
  for name in want:
    assert np.all(want[name][:3] > 0), name
    np.testing.assert_allclose(got[name][:3], want[name][:3], rtol=1e-5, err_msg=name)
  want_logp = jax.jit(functools.partial(M.token_logprobs, cfg=cfg))(params, tokens_BxT=tokens, mask_BxT=mask)
  assert_per_token_close(aux["logp_BxT"], want_logp, "logp_BxT")


def test_explicit_norms_one_sequence_at_a_time(monkeypatch):
  """Large explicit temporaries are formed per sequence (lax.map); forced here with a zero budget."""
  cfg, params, tokens, mask = _setup(False)
  monkeypatch.setattr(op_norms, "EXPLICIT_BATCH_BYTES", 0)
  sq_B, _ = jax.jit(functools.partial(G.per_sequence_sq_norms, cfg=cfg, mode="explicit"))(
      params, tokens_BxT=tokens, mask_BxT=mask)
  np.testing.assert_allclose(sq_B[:3], sum(_leaf_sq(_brute(False)).values())[:3], rtol=1e-5)


def test_dropping_a_leaf_changes_the_total(monkeypatch):
  cfg, params, tokens, mask = _setup(False)
  want_B = sum(_leaf_sq(_brute(False)).values())[:3]
  rule = G._leaf_sq_norms

  def without_up_proj(path, *args):
    sq_B = rule(path, *args)
    return jnp.zeros_like(sq_B) if path == ("layers_0", "mlp", "up_proj", "kernel") else sq_B

  monkeypatch.setattr(G, "_leaf_sq_norms", without_up_proj)
  sq_B, _ = jax.jit(functools.partial(G.per_sequence_sq_norms, cfg=cfg))(params, tokens_BxT=tokens,
                                                                         mask_BxT=mask)
  assert np.all(np.abs(np.asarray(sq_B[:3]) / want_B - 1) > 1e-3)


def _coef_fn(sq_B, logp_BxT, ent_BxT):
  """Coefficients that depend on all three inputs, like the learner's (sign, 1/L, 1/B, norm-weighted)."""
  L_B = jnp.maximum(jnp.sum(logp_BxT != 0, axis=1), 1).astype(jnp.float32)
  c_B = -(jnp.sqrt(sq_B) / (1.0 + jnp.sqrt(sq_B)) + 0.1 * jnp.sum(ent_BxT, axis=1)) / (L_B * B)
  return c_B, {"L_B": L_B}


@pytest.mark.slow
@pytest.mark.parametrize("tied,two_pass", [(False, False), (True, False), (False, True)])
def test_weighted_grad_matches_vmap_and_jax_grad(tied, two_pass):
  cfg, params, tokens, mask = _setup(tied)
  fn = G.per_sequence_sq_norms_and_grad_two_pass if two_pass else G.per_sequence_sq_norms_and_grad
  grads, sq_B, aux = jax.jit(functools.partial(fn, cfg=cfg, coef_fn=_coef_fn))(
      params, tokens_BxT=tokens, mask_BxT=mask)
  want_B = sum(_leaf_sq(_brute(tied)).values())
  np.testing.assert_allclose(sq_B[:3], want_B[:3], rtol=1e-5)
  c_B, _ = _coef_fn(sq_B, aux["logp_BxT"], aux["ent_BxT"])
  np.testing.assert_allclose(aux["coef_B"], c_B, rtol=1e-6)

  @jax.jit
  def references(p, c_B, per_seq):
    def weighted_loss(p):  # ordinary backward of the weighted loss, coefficients frozen
      return jnp.sum(c_B[:, None] * M.token_logprobs(p, cfg, tokens, mask))
    return jax.grad(weighted_loss)(p), jax.tree.map(lambda x: jnp.tensordot(c_B, x, axes=1), per_seq)

  want_jax, want_vmap = references(params, c_B, _brute(tied))
  for want in (want_jax, want_vmap):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
      scale = float(jnp.max(jnp.abs(w)))
      assert scale > 0, path
      np.testing.assert_allclose(g / scale, w / scale, atol=1e-5, err_msg=str(path))


def test_bfloat16_compute_stays_close():
  cfg, params, tokens, mask = _setup(False)
  cfg16 = model_config.ModelConfig(**{**cfg.to_dict(), "dtype": "bfloat16"})
  sq32, _ = _norms_fn(cfg)(params, tokens_BxT=tokens, mask_BxT=mask)
  sq16, _ = _norms_fn(cfg16)(params, tokens_BxT=tokens, mask_BxT=mask)
  assert sq16.dtype == jnp.float32
  np.testing.assert_allclose(sq16[:3], sq32[:3], rtol=0.1)


def test_bad_mode_names_field():
  cfg, params, tokens, mask = _setup(False)
  with pytest.raises(ValueError, match="mode"):
    G.per_sequence_sq_norms(params, cfg, tokens, mask, mode="fast")


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_norms_and_grad_equal_the_full_logits_path(tied):
  """model.logits_chunk < vocab (3 chunks, the last overlapping) gives the full-logits path's norms, log-probs
  and weighted gradient: the capture's shared log-sum-exp pass feeds every head term."""
  import dataclasses
  cfg, params, tokens, mask = _setup(tied)
  coef = lambda sq_B, logp_BxT, ent_BxT: (1.0 / (1.0 + sq_B), None)
  out = {}
  for chunk in (0, 16):
    c = dataclasses.replace(cfg, logits_chunk=chunk)
    fn = jax.jit(functools.partial(G.per_sequence_sq_norms_and_grad, cfg=c, coef_fn=coef))
    out[chunk] = fn(params, tokens_BxT=tokens, mask_BxT=mask)
  (g0, sq0, aux0), (g1, sq1, aux1) = out[0], out[16]
  np.testing.assert_allclose(sq1, sq0, rtol=1e-5)
  np.testing.assert_allclose(aux1["logp_BxT"], aux0["logp_BxT"], rtol=1e-5, atol=1e-6)
  for k, v in aux0["leaf_sq_norms"].items():
    np.testing.assert_allclose(aux1["leaf_sq_norms"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)
  chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-7)  # names the leaf that differs


def test_logits_chunk_is_validated():
  with pytest.raises(ValueError, match="model.logits_chunk"):
    model_config.ModelConfig(logits_chunk=-1)
