"""bounded_norms: layer-by-layer per-sequence norms and the weighted gradient vs book-keeping and vmap(grad)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from test_grad_norms import assert_per_token_close, padded_rows, perturbed_params
from vcpo_jax.learner import bounded_norms as BN
from vcpo_jax.learner import grad_norms as G
from vcpo_jax.model import transformer as M

B, T = 4, 10
HIGHEST = "highest"


def _cfg(tied: bool, scan: bool = False, remat: str = "none", layers: int = 2) -> M.ModelConfig:
  # GQA (4 query heads over 2 kv heads), biases on q/k/v, two layers so the scan really stacks.
  return M.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=4, max_seq_len=32, tie_word_embeddings=tied,
                       scan_layers=scan, remat=remat)


@functools.lru_cache(maxsize=None)
def _setup(tied: bool):
  """Unrolled params with non-trivial norms/biases; repeated tokens, prompts, unequal lengths, padding."""
  cfg = _cfg(tied)
  tokens, mask, key_mask = padded_rows(B, T)
  return cfg, perturbed_params(cfg), tokens, mask, key_mask


def _params_for(cfg, params):
  return M.stack_layers(params, cfg.num_layers) if cfg.scan_layers else params


@functools.lru_cache(maxsize=None)
def _brute(tied: bool):
  """Per-leaf per-sequence squared norms by vmap(grad) of each row's own summed response log-prob."""
  cfg, params, tokens, mask, key_mask = _setup(tied)

  def seq_logp(p, tok_T, m_T, k_T):
    return jnp.sum(M.token_logprobs(p, cfg, tok_T[None], m_T[None], key_mask_BxT=k_T[None]))

  with jax.default_matmul_precision(HIGHEST):
    per_seq = jax.jit(jax.vmap(jax.grad(seq_logp), in_axes=(None, 0, 0, 0)))(params, tokens, mask, key_mask)
  leaf = {"/".join(k): np.sum(np.square(np.asarray(v, np.float64).reshape(B, -1)), axis=1)
          for k, v in traverse_util.flatten_dict(per_seq).items()}
  return leaf, per_seq


def _coef_fn(sq_B, logp_BxT, ent_BxT):
  L_B = jnp.maximum(jnp.sum(logp_BxT != 0, axis=1), 1).astype(jnp.float32)
  return -(jnp.sqrt(sq_B) / (1.0 + jnp.sqrt(sq_B)) + 0.1 * jnp.sum(ent_BxT, axis=1)) / (L_B * B), None


def _run(fn, cfg, params, tokens, mask, key_mask, mode="auto"):
  with jax.default_matmul_precision(HIGHEST):
    return jax.jit(functools.partial(fn, cfg=cfg, coef_fn=_coef_fn, mode=mode))(
        _params_for(cfg, params), tokens_BxT=tokens, mask_BxT=mask, key_mask_BxT=key_mask)


@pytest.mark.slow
@pytest.mark.parametrize("tied,scan,remat,mode", [
    (False, False, "none", "auto"), (True, False, "dots", "ghost"), (False, True, "none", "explicit"),
    (True, True, "full", "auto"), (False, True, "dots", "auto"), (True, True, "dots_no_batch", "auto")])
def test_bounded_equals_bookkeeping_and_vmap_grad(tied, scan, remat, mode):
  _, params, tokens, mask, key_mask = _setup(tied)
  cfg = _cfg(tied, scan, remat)
  want_leaf, per_seq = _brute(tied)
  grads, sq_B, aux = _run(BN.per_sequence_sq_norms_and_grad, cfg, params, tokens, mask, key_mask, mode)
  bk_grads, bk_sq_B, bk_aux = _run(G.per_sequence_sq_norms_and_grad, cfg, params, tokens, mask, key_mask, mode)
  want_B = sum(want_leaf.values())
  np.testing.assert_allclose(sq_B[:3], want_B[:3], rtol=1e-5)
  np.testing.assert_allclose(sq_B, bk_sq_B, rtol=1e-5, atol=1e-7)
  assert float(sq_B[3]) == 0.0
  assert_per_token_close(aux["logp_BxT"], bk_aux["logp_BxT"], "logp_BxT")
  assert_per_token_close(aux["ent_BxT"], bk_aux["ent_BxT"], "ent_BxT")
  # Every leaf has its own entry and matches alone (the k bias is ~1e-5 of the total: it cannot hide).
  assert set(aux["leaf_sq_norms"]) == set(bk_aux["leaf_sq_norms"])
  for name, v in aux["leaf_sq_norms"].items():
    assert np.all(np.asarray(v)[:3] > 0), name
    np.testing.assert_allclose(v, bk_aux["leaf_sq_norms"][name], rtol=1e-5, atol=1e-9, err_msg=name)
  if not scan:
    for name, v in aux["leaf_sq_norms"].items():
      np.testing.assert_allclose(v[:3], want_leaf[name][:3], rtol=1e-5, err_msg=name)
  c_B = aux["coef_B"]
  want_vmap = jax.tree.map(lambda x: jnp.tensordot(c_B, x, axes=1, precision=HIGHEST), per_seq)
  want_vmap = _params_for(cfg, want_vmap)
  for (path, g), bk, w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(bk_grads),
                              jax.tree.leaves(want_vmap)):
    scale = float(jnp.max(jnp.abs(w)))
    assert scale > 0, path
    np.testing.assert_allclose(g / scale, w / scale, atol=1e-5, err_msg=str(path))
    np.testing.assert_allclose(g / scale, bk / scale, atol=1e-5, err_msg=str(path))


@pytest.mark.slow
def test_bfloat16_compute_stays_close_to_float32():
  """bf16 activations (the 7B setting): the taps' cotangents stay float32 and the norms near float32's."""
  _, params, tokens, mask, key_mask = _setup(False)
  cfg = _cfg(False, scan=True)
  out = {}
  for dtype in ("float32", "bfloat16"):
    c = dataclasses.replace(cfg, dtype=dtype)
    out[dtype] = _run(BN.per_sequence_sq_norms_and_grad, c, params, tokens, mask, key_mask)
  assert out["bfloat16"][1].dtype == jnp.float32
  np.testing.assert_allclose(out["bfloat16"][1][:3], out["float32"][1][:3], rtol=0.1)


def test_a_parameter_without_a_tap_fails_loudly():
  """A parameter that no tapped op reads (here an extra leaf) would vanish from every norm: refused, named."""
  cfg, params, tokens, mask, key_mask = _setup(False)
  params = {**params, "extra_scale": jnp.ones((3,))}
  with pytest.raises(ValueError, match="extra_scale"):
    jax.eval_shape(lambda p: BN.per_sequence_sq_norms(p, cfg, tokens, mask), params)


def test_dropping_a_leaf_contribution_changes_the_total(monkeypatch):
  """If the rule of one leaf (here the RMSNorm scales' rule) returned 0, the totals would move well beyond
  the tolerance the exactness test uses: no leaf is too small to be checked."""
  from vcpo_jax.learner import norm_taps
  cfg, params, tokens, mask, key_mask = _setup(False)
  want_B = sum(_brute(False)[0].values())[:3]
  monkeypatch.setattr(norm_taps.op_norms, "scale_sq_norms", lambda xhat, g: jnp.zeros(xhat.shape[:1], jnp.float32))
  with jax.default_matmul_precision(HIGHEST):
    sq_B, _ = jax.jit(functools.partial(BN.per_sequence_sq_norms, cfg=cfg))(
        params, tokens_BxT=tokens, mask_BxT=mask, key_mask_BxT=key_mask)
  assert np.all(np.abs(np.asarray(sq_B[:3]) / want_B - 1) > 1e-4)


@pytest.mark.slow
def test_bounded_keeps_no_per_layer_stack():
  """The compiled norms pass holds no [L, B, T, width] stack: its temporaries at 4 layers stay within a
  small margin of an ordinary backward's, while book-keeping's grow by the stored a/g."""
  cfg = dataclasses.replace(_cfg(False, True, "full", layers=4), hidden_size=64, intermediate_size=256,
                            num_heads=4, head_dim=16, max_seq_len=128)
  b, t = 4, 128
  params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))
  tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
  msk = jax.ShapeDtypeStruct((b, t), jnp.float32)
  coef = lambda sq_B, logp_BxT, ent_BxT: (sq_B, None)

  def temp(fn):
    return jax.jit(fn).lower(params, tok, msk).compile().memory_analysis().temp_size_in_bytes

  plain = temp(lambda p, x, m: jax.grad(lambda p: jnp.sum(M.token_logprobs(p, cfg, x, m)))(p))
  bounded = temp(lambda p, x, m: BN.per_sequence_sq_norms_and_grad(p, cfg, x, m, coef)[0])
  book = temp(lambda p, x, m: G.per_sequence_sq_norms_and_grad(p, cfg, x, m, coef)[0])
  stack = 4 * b * t * (cfg.hidden_size * 4 + cfg.intermediate_size * 3) * 4  # a/g of the MLP alone, bytes
  assert book - plain > stack
  assert bounded - plain < stack / 4, (plain, bounded, book)


def test_all_zero_cotangent_gives_zero_gradient_without_a_backward():
  """grad_of runs the ordinary backward inside a cond on a nonzero cotangent (bounded_norms: so that its
  gradient buffers are not allocated during the norms backward); the skipped branch is exact: zeros, in the
  parameters' structure and dtypes. A nonzero cotangent gives the plain backward's gradient."""
  cfg, params, tokens, mask, key_mask = _setup(False)
  d_BxT = jnp.linspace(-1.0, 1.0, B * T).reshape(B, T) * mask

  def both(p):
    _, _, grad_of = BN.sq_norms_and_vjp(p, cfg, tokens, mask, key_mask_BxT=key_mask)
    want = jax.grad(lambda q: jnp.sum(d_BxT * M.token_logprobs(q, cfg, tokens, mask, key_mask_BxT=key_mask)))(p)
    return grad_of(jnp.zeros((B, T), jnp.float32)), grad_of(d_BxT), want

  with jax.default_matmul_precision(HIGHEST):
    zero, got, want = jax.jit(both)(params)
  assert jax.tree.structure(zero) == jax.tree.structure(params)
  for z, p in zip(jax.tree.leaves(zero), jax.tree.leaves(params)):
    assert z.dtype == p.dtype and z.shape == p.shape and not np.any(np.asarray(z))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(np.max(np.abs(w))) or 1.0
    np.testing.assert_allclose(np.asarray(g) / scale, np.asarray(w) / scale, atol=1e-5)
