"""The plain LM head (full [B, T, V] float32 logits): lm_head's chunk=0 path and the reference its chunked
formulation is tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Shape letters and conventions as in lm_head.py.
_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def logits(x_BxTxD, w_DxV, precision=_HIGHEST):
  """Float32 logits (inputs in their compute dtype, float32 accumulation)."""
  return jnp.einsum("btd,dv->btv", x_BxTxD, w_DxV.astype(x_BxTxD.dtype), preferred_element_type=_F32,
                    precision=precision)


def next_tokens(tokens_BxT):
  """nxt[:, t] = tokens[:, t+1]; the last position's target is a dummy (its predicting mask is 0)."""
  return jnp.concatenate([tokens_BxT[:, 1:], tokens_BxT[:, :1]], axis=1)


def shift_mask(mask_BxT):
  """Mask of the predicting positions: m'[:, t] = mask[:, t+1], m'[:, T-1] = 0."""
  m = mask_BxT.astype(_F32)
  return jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)


def use_ghost(mode: str, t: int, d: int, v: int) -> bool:
  """Ghost Gram (~T^2 (D + V) per sequence) when cheaper than the explicit [D, V] gradient (~T D V)."""
  return t * (d + v) < d * v if mode == "auto" else mode == "ghost"


def logprobs_and_entropy(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision=_HIGHEST):
  logz_BxTxV = jax.nn.log_softmax(logits(x_BxTxD[:, :-1], w_DxV, precision), axis=-1)
  logp_BxTm1 = jnp.take_along_axis(logz_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
  ent_BxTm1 = -jnp.sum(jnp.exp(logz_BxTxV) * logz_BxTxV, axis=-1)
  pad = jnp.zeros((tokens_BxT.shape[0], 1), _F32)
  m = mask_BxT.astype(_F32)
  return (jnp.concatenate([pad, logp_BxTm1], axis=1) * m, jnp.concatenate([pad, ent_BxTm1], axis=1) * m)


def logit_grads(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision=_HIGHEST):
  """Plain g[b, t] = m'_t (onehot(tokens[t+1]) - softmax(logits[t])), [B, T, V]."""
  p_BxTxV = jax.nn.softmax(logits(x_BxTxD, w_DxV, precision), axis=-1)
  onehot = jax.nn.one_hot(next_tokens(tokens_BxT), w_DxV.shape[-1], dtype=_F32)
  return (onehot - p_BxTxV) * shift_mask(mask_BxT)[:, :, None]


def head_sq_norms(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, mode="auto", precision=_HIGHEST):
  g_BxTxV = logit_grads(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision)
  x = x_BxTxD.astype(_F32)
  if use_ghost(mode, x.shape[1], x.shape[2], w_DxV.shape[1]):
    gram_x = jnp.einsum("btd,bsd->bts", x, x, preferred_element_type=_F32)
    gram_g = jnp.einsum("btv,bsv->bts", g_BxTxV, g_BxTxV, preferred_element_type=_F32)
    return jnp.maximum(jnp.sum(gram_x * gram_g, axis=(1, 2)), 0.0)
  dw_BxDxV = jnp.einsum("btd,btv->bdv", x, g_BxTxV, preferred_element_type=_F32)
  return jnp.sum(jnp.square(dw_BxDxV), axis=(1, 2))


def head_weighted_grad(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, c_B, precision=_HIGHEST):
  g_BxTxV = logit_grads(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision)
  xc_BxTxD = x_BxTxD.astype(_F32) * c_B.astype(_F32)[:, None, None]
  return jnp.einsum("btd,btv->dv", xc_BxTxD, g_BxTxV, preferred_element_type=_F32)


def tied_cross_terms(tokens_BxT, g_embed_BxTxD, x_BxSxD, w_DxV, mask_BxT, precision=_HIGHEST):
  g_BxSxV = logit_grads(x_BxSxD, w_DxV, tokens_BxT, mask_BxT, precision)
  s = x_BxSxD.shape[1]
  ids_BxSxT = jnp.broadcast_to(tokens_BxT[:, None, :], (tokens_BxT.shape[0], s, tokens_BxT.shape[1]))
  gh_at_ids_BxSxT = jnp.take_along_axis(g_BxSxV, ids_BxSxT, axis=2)
  ex_BxSxT = jnp.einsum("btd,bsd->bst", g_embed_BxTxD.astype(_F32), x_BxSxD.astype(_F32),
                        preferred_element_type=_F32)
  return jnp.sum(gh_at_ids_BxSxT * ex_BxSxT, axis=(1, 2))
