"""lm_head: the vocabulary-chunked head and the token-tiled head (custom VJPs) equal the plain full-logits
formulation (chunk=0)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import lm_head as L
from vcpo_jax.model import lm_head_plain
from tests.model_jit import dot_operand_dtypes

B, T, D, V = 3, 7, 8, 37   # V = 4 chunks of 8 + an overlapping last chunk that owns 5 columns
CHUNK = 8


@functools.lru_cache(maxsize=None)
def _inputs():
  kx, kw, kt = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (B, T, D))
  w = 0.7 * jax.random.normal(kw, (D, V))
  tokens = jax.random.randint(kt, (B, T), 0, V).at[:, 3].set(V - 1).at[0, 5].set(0)  # last column too
  mask = jnp.array([[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], jnp.float32)
  return x, w, tokens, mask


def _close(a, b, tol=1e-5):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(b)))))


@pytest.mark.parametrize("chunk", [CHUNK, 1000])
def test_logprobs_and_entropy_match_plain(chunk):
  x, w, tokens, mask = _inputs()
  got = jax.jit(functools.partial(L.token_logprobs_and_entropy, chunk=chunk))(x, w, tokens, mask)
  ref = jax.jit(functools.partial(L.token_logprobs_and_entropy, chunk=0))(x, w, tokens, mask)
  for g, r in zip(got, ref):
    assert g.dtype == jnp.float32
    _close(g, r)
  assert float(jnp.max(ref[1])) > 1.0  # entropies are far from 0: the test is not vacuous


def _loss(chunk, tied, token_tile=0):
  """A loss mixing log-probs and entropies (an entropy bonus) with per-token weights, of (x, w) or, tied,
  of (x, E): E = w^T feeds x by its rows and is the head, passed as it is (vocab_major)."""
  _, _, tokens, mask = _inputs()
  a = jax.random.normal(jax.random.PRNGKey(3), (B, T))
  b = jax.random.normal(jax.random.PRNGKey(4), (B, T))

  def f(x, w):
    if tied:
      x = jnp.tanh(x + w[tokens])   # w is E [V, D]: gradients reach it through x and the head
    logp, ent = L.token_logprobs_and_entropy(x, w, tokens, mask, chunk=chunk, vocab_major=tied,
                                             token_tile=token_tile)
    return jnp.sum(a * logp) + 0.3 * jnp.sum(b * ent)
  return f


@pytest.mark.parametrize("tied,chunk", [(False, CHUNK), (True, 5)])
def test_gradients_wrt_x_and_w_match_plain(tied, chunk):
  x, w, _, _ = _inputs()
  w = w.T if tied else w
  got = jax.jit(jax.grad(_loss(chunk, tied), argnums=(0, 1)))(x, w)
  ref = jax.jit(jax.grad(_loss(0, tied), argnums=(0, 1)))(x, w)
  for g, r in zip(got, ref):
    assert g.shape == r.shape and g.dtype == r.dtype
    _close(g, r)
  dw_DxV = ref[1].T if tied else ref[1]
  assert float(jnp.max(jnp.abs(dw_DxV[:, V - 1]))) > 0  # the overlapping last chunk's own column is trained


@pytest.mark.parametrize("tied,tile", [(False, 8), (True, 5), (True, 64)])
def test_token_tiles_match_plain(tied, tile):
  """model.lm_head="token_tiles": log-probs, entropies and gradients wrt x and the head equal the plain path's
  with tiles that do not divide the B*T = 21 tokens (padded rows) and with one tile of every token."""
  x, w, tokens, mask = _inputs()
  w = w.T if tied else w
  f = lambda x, w: L.token_logprobs_and_entropy(x, w, tokens, mask, chunk=CHUNK, vocab_major=tied, token_tile=tile)
  got = jax.jit(f)(x, w)
  ref = jax.jit(lambda x, w: L.token_logprobs_and_entropy(x, w, tokens, mask, chunk=0, vocab_major=tied))(x, w)
  for g, r in zip(got, ref):
    assert g.dtype == jnp.float32
    _close(g, r)
  got = jax.jit(jax.grad(_loss(CHUNK, tied, tile), argnums=(0, 1)))(x, w)
  ref = jax.jit(jax.grad(_loss(0, tied), argnums=(0, 1)))(x, w)
  for g, r in zip(got, ref):
    assert g.shape == r.shape and g.dtype == r.dtype
    _close(g, r)


def test_token_tiles_multiply_bfloat16_operands_forward_and_backward():
  """bf16 compute: every head GEMM of the token-tiled path (forward and the VJP's two) reads bf16 operands
  (float32 accumulation), while the plain path's autodiff backward multiplies float32 logit gradients."""
  x, w, tokens, mask = _inputs()
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.float32)  # float32 params, bf16 compute (the learner's)
  def grad_jaxpr(**kw):
    loss = lambda x, w: jnp.sum(L.token_logprobs_and_entropy(x, w, tokens, mask, **kw)[0])
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(xb, wb).jaxpr
  assert set(dot_operand_dtypes(grad_jaxpr(chunk=CHUNK, token_tile=8))) == {("bfloat16", "bfloat16")}
  assert set(dot_operand_dtypes(grad_jaxpr(chunk=CHUNK))) == {("bfloat16", "bfloat16")}  # vocabulary chunks too
  assert any("float32" in dtypes for dtypes in dot_operand_dtypes(grad_jaxpr(chunk=0)))


@pytest.mark.parametrize("mode", ["ghost", "explicit"])
def test_head_sq_norms_match_plain(mode):
  x, w, tokens, mask = _inputs()
  got = jax.jit(functools.partial(L.head_sq_norms, mode=mode, chunk=CHUNK))(x, w, tokens, mask)
  ref = jax.jit(functools.partial(L.head_sq_norms, mode=mode, chunk=0))(x, w, tokens, mask)
  _close(got, ref)
  assert float(ref[2]) == 0.0 and float(jnp.min(ref[:2])) > 0  # the all-masked row has no gradient


def test_head_weighted_grad_and_tied_cross_terms_match_plain():
  x, w, tokens, mask = _inputs()
  c_B = jnp.array([0.5, -2.0, 3.0])
  g_embed = jax.random.normal(jax.random.PRNGKey(5), (B, T, D))

  @functools.partial(jax.jit, static_argnums=0)
  def terms(chunk):
    lse = L.logsumexp(x, w, chunk=CHUNK) if chunk else None
    f = lambda w: jnp.sum(c_B[:, None] * L.token_logprobs_and_entropy(x, w, tokens, mask, chunk=chunk)[0])
    e = w.T   # the same head given vocab-major (a tied embedding): same values, [V, D] gradient
    return (L.head_weighted_grad(x, w, tokens, mask, c_B, chunk=chunk),
            L.head_weighted_grad(x, w, tokens, mask, c_B, chunk=chunk, lse_BxT=lse),
            L.head_weighted_grad(x, e, tokens, mask, c_B, chunk=chunk, vocab_major=True).T,
            L.tied_cross_terms(tokens, g_embed, x, w, mask, chunk=chunk),
            L.tied_cross_terms(tokens, g_embed, x, e, mask, chunk=chunk, vocab_major=True),
            L.head_sq_norms(x, e, tokens, mask, "ghost", chunk=chunk, vocab_major=True),
            jax.grad(f)(w))

  got, ref = terms(CHUNK), terms(0)
  for g, r in zip(got, ref):
    _close(g, r)
  _close(got[0], got[-1])  # the weighted gradient is autodiff of the weighted log-prob sum
  _close(L.logsumexp(x, w, chunk=CHUNK), jax.nn.logsumexp(lm_head_plain.logits(x, w), axis=-1))


def test_bfloat16_inputs_give_float32_logprobs_close_to_float32():
  x, w, tokens, mask = _inputs()
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  f = lambda x, w: L.token_logprobs_and_entropy(x, w, tokens, mask, chunk=CHUNK)
  (logp, ent), vjp = jax.vjp(jax.jit(f), xb, wb)
  assert logp.dtype == ent.dtype == jnp.float32
  ref = jax.jit(f)(xb.astype(jnp.float32), wb.astype(jnp.float32))
  np.testing.assert_allclose(logp, ref[0], atol=0.1)
  dx, dw = vjp((jnp.ones_like(logp), jnp.zeros_like(ent)))
  assert dx.dtype == dw.dtype == jnp.bfloat16


@pytest.mark.parametrize("chunk", [-1, 2.5, True, "8"])
def test_bad_chunk_names_the_field(chunk):
  x, w, tokens, mask = _inputs()
  with pytest.raises(ValueError, match="chunk="):
    L.token_logprobs_and_entropy(x, w, tokens, mask, chunk=chunk)


@pytest.mark.parametrize("tile", [-1, 2.5, True])
def test_bad_token_tile_names_the_field(tile):
  x, w, tokens, mask = _inputs()
  with pytest.raises(ValueError, match="token_tile="):
    L.token_logprobs_and_entropy(x, w, tokens, mask, token_tile=tile)


def test_chunked_grad_never_holds_full_logits():
  """Compile only: XLA temporaries of grad(sum logp) stay below ONE [tokens, V] float32 array chunked,
  while the plain path needs several."""
  n_bytes = 128 * 2048 * 4   # B*T tokens x V x float32
  plain = L.head_grad_temporaries(b=2, t=64, d=16, v=2048, chunk=0, tied=True)
  chunked = L.head_grad_temporaries(b=2, t=64, d=16, v=2048, chunk=128, tied=True)
  assert plain["temp_bytes"] > 2 * n_bytes
  assert chunked["temp_bytes"] < n_bytes / 2
