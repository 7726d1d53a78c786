"""LM head: token log-probs, entropies and the head's per-sequence gradient terms from final hidden states."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Shape letters: B batch, T length, D hidden, V vocab. Position t's logits predict token t+1: logp[:, t] is
# log p(tokens[:, t] | tokens[:, :t]) and logp[:, 0] = 0, as in model.logprobs_from_logits.
# The head kernel w_DxV is lm_head/kernel, or embed_tokens.T when the embeddings are tied.
_F32 = jnp.float32


def logits(x_BxTxD, w_DxV, precision=jax.lax.Precision.HIGHEST):
  """Float32 logits (inputs in their compute dtype, float32 accumulation)."""
  return jnp.einsum("btd,dv->btv", x_BxTxD, w_DxV.astype(x_BxTxD.dtype), preferred_element_type=_F32,
                    precision=precision)


def _shift_mask(mask_BxT):
  """Mask of the predicting positions: m'[:, t] = mask[:, t+1], m'[:, T-1] = 0."""
  m = mask_BxT.astype(_F32)
  return jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)


def token_logprobs_and_entropy(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision=jax.lax.Precision.HIGHEST):
  """(logp_BxT, ent_BxT), masked, float32: log p(tokens[t] | :t) and the entropy of that distribution."""
  logz_BxTxV = jax.nn.log_softmax(logits(x_BxTxD[:, :-1], w_DxV, precision), axis=-1)
  logp_BxTm1 = jnp.take_along_axis(logz_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
  ent_BxTm1 = -jnp.sum(jnp.exp(logz_BxTxV) * logz_BxTxV, axis=-1)
  pad = jnp.zeros((tokens_BxT.shape[0], 1), _F32)
  m = mask_BxT.astype(_F32)
  return (jnp.concatenate([pad, logp_BxTm1], axis=1) * m, jnp.concatenate([pad, ent_BxTm1], axis=1) * m)


def logit_grads(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision=jax.lax.Precision.HIGHEST):
  """g[b, t] = d(sum_s m_s logp_s)/d logits[b, t] = m'_t (onehot(tokens[t+1]) - softmax(logits[t]))."""
  p_BxTxV = jax.nn.softmax(logits(x_BxTxD, w_DxV, precision), axis=-1)
  nxt_BxT = jnp.concatenate([tokens_BxT[:, 1:], tokens_BxT[:, :1]], axis=1)
  onehot = jax.nn.one_hot(nxt_BxT, w_DxV.shape[-1], dtype=_F32)
  return (onehot - p_BxTxV) * _shift_mask(mask_BxT)[:, :, None]


def head_sq_norms(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, mode: str = "auto",
                  precision=jax.lax.Precision.HIGHEST):
  """||x_i^T g_i||_F^2 per sequence: the squared norm of sequence i's head-kernel gradient."""
  g_BxTxV = logit_grads(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision)
  t, d, v = x_BxTxD.shape[1], x_BxTxD.shape[2], w_DxV.shape[1]
  ghost = t * (d + v) < d * v if mode == "auto" else mode == "ghost"
  x = x_BxTxD.astype(_F32)
  if ghost:
    gram_x = jnp.einsum("btd,bsd->bts", x, x, preferred_element_type=_F32)
    gram_g = jnp.einsum("btv,bsv->bts", g_BxTxV, g_BxTxV, preferred_element_type=_F32)
    return jnp.maximum(jnp.sum(gram_x * gram_g, axis=(1, 2)), 0.0)
  dw_BxDxV = jnp.einsum("btd,btv->bdv", x, g_BxTxV, preferred_element_type=_F32)
  return jnp.sum(jnp.square(dw_BxDxV), axis=(1, 2))


def head_weighted_grad(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, c_B, precision=jax.lax.Precision.HIGHEST):
  """sum_i c_i x_i^T g_i: the head-kernel gradient of sum_i c_i sum_t m_t logp_t (c constant), [D, V]."""
  g_BxTxV = logit_grads(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision)
  xc_BxTxD = x_BxTxD.astype(_F32) * c_B.astype(_F32)[:, None, None]
  return jnp.einsum("btd,btv->dv", xc_BxTxD, g_BxTxV, preferred_element_type=_F32)


def tied_cross_terms(tokens_BxT, g_embed_BxTxD, x_BxSxD, w_DxV, mask_BxT,
                     precision=jax.lax.Precision.HIGHEST):
  """<E_i, H_i^T> between sequence i's embedding gradient (row scatter of g_embed by token id) and its head
  gradient: sum_{t,s} g_head[s, id_t] <g_embed_t, x_s>."""
  g_BxSxV = logit_grads(x_BxSxD, w_DxV, tokens_BxT, mask_BxT, precision)
  s = x_BxSxD.shape[1]
  ids_BxSxT = jnp.broadcast_to(tokens_BxT[:, None, :], (tokens_BxT.shape[0], s, tokens_BxT.shape[1]))
  gh_at_ids_BxSxT = jnp.take_along_axis(g_BxSxV, ids_BxSxT, axis=2)
  ex_BxSxT = jnp.einsum("btd,bsd->bst", g_embed_BxTxD.astype(_F32), x_BxSxD.astype(_F32),
                        preferred_element_type=_F32)
  return jnp.sum(gh_at_ids_BxSxT * ex_BxSxT, axis=(1, 2))
