"""Per-op rules: per-sequence squared gradient norms and weighted gradients of dense, bias, scale, embedding ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Shape letters: B batch, T/S length (query/key index of a Gram), I/O dense in/out, D hidden, V vocab.

MODES = ("auto", "ghost", "explicit")
# Explicit per-sequence dW temporaries above this size (B x I x O float32) are formed one sequence at a
# time (lax.map) instead of all at once.
EXPLICIT_BATCH_BYTES = 1 << 28
_F32 = jnp.float32


def check_mode(mode: str):
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got mode={mode!r}")


def _use_ghost(mode: str, t: int, d_in: int, d_out: int) -> bool:
  """Ghost costs ~T^2 (I+O) per sequence, explicit ~T I O: pick the smaller (static, per layer)."""
  if mode == "auto":
    return t * (d_in + d_out) < d_in * d_out
  return mode == "ghost"


def _gram(x_BxTxK):
  return jnp.einsum("btk,bsk->bts", x_BxTxK, x_BxTxK, preferred_element_type=_F32)


# ---------------------------------------------------------------------------------------------------------
# Per-sequence squared norms of one parameter kind.
# ---------------------------------------------------------------------------------------------------------

def dense_sq_norms(a_BxTxI, g_BxTxO, mode: str = "auto"):
  """||a_i^T g_i||_F^2 for each sequence i."""
  _, t, d_in = a_BxTxI.shape
  if _use_ghost(mode, t, d_in, g_BxTxO.shape[-1]):
    return jnp.maximum(jnp.sum(_gram(a_BxTxI) * _gram(g_BxTxO), axis=(1, 2)), 0.0)
  if 4 * a_BxTxI.shape[0] * d_in * g_BxTxO.shape[-1] > EXPLICIT_BATCH_BYTES:
    def one(ag):
      dw_IxO = jnp.einsum("ti,to->io", ag[0], ag[1], preferred_element_type=_F32)
      return jnp.sum(jnp.square(dw_IxO))
    return jax.lax.map(one, (a_BxTxI, g_BxTxO))
  dw_BxIxO = jnp.einsum("bti,bto->bio", a_BxTxI, g_BxTxO, preferred_element_type=_F32)
  return jnp.sum(jnp.square(dw_BxIxO), axis=(1, 2))


def bias_sq_norms(g_BxTxO):
  return jnp.sum(jnp.square(jnp.sum(g_BxTxO.astype(_F32), axis=1)), axis=-1)


def scale_sq_norms(xhat_BxTxD, g_BxTxD):
  """RMSNorm scale: the per-sequence gradient sum_t xhat_t * g_t is only D long, so explicit."""
  dscale_BxD = jnp.einsum("btd,btd->bd", xhat_BxTxD, g_BxTxD, preferred_element_type=_F32)
  return jnp.sum(jnp.square(dscale_BxD), axis=-1)


def _one_hot(tokens_BxT, vocab_size: int):
  return jax.nn.one_hot(tokens_BxT, vocab_size, dtype=_F32)


def embedding_sq_norms(tokens_BxT, g_BxTxD, vocab_size: int, mode: str = "auto"):
  """Squared norm of the row-scatter of g by token id: sum_{t,s: id_t = id_s} <g_t, g_s>."""
  ghost = tokens_BxT.shape[1] < vocab_size if mode == "auto" else mode == "ghost"  # T^2 D vs T V D FLOPs
  if ghost:
    same_BxTxS = tokens_BxT[:, :, None] == tokens_BxT[:, None, :]
    return jnp.maximum(jnp.sum(jnp.where(same_BxTxS, _gram(g_BxTxD), 0.0), axis=(1, 2)), 0.0)
  de_BxVxD = jnp.einsum("btv,btd->bvd", _one_hot(tokens_BxT, vocab_size), g_BxTxD,
                        preferred_element_type=_F32)
  return jnp.sum(jnp.square(de_BxVxD), axis=(1, 2))


# ---------------------------------------------------------------------------------------------------------
# Per-sequence-weighted gradients sum_i c_i (per-sequence gradient_i) of one parameter kind.
# ---------------------------------------------------------------------------------------------------------

def _scaled(x_BxTxK, c_B):
  return x_BxTxK.astype(_F32) * c_B.astype(_F32)[:, None, None]


def dense_weighted_grad(a_BxTxI, g_BxTxO, c_B):
  # Scale the narrower operand: the weighting costs B T min(I, O).
  if a_BxTxI.shape[-1] <= g_BxTxO.shape[-1]:
    return jnp.einsum("bti,bto->io", _scaled(a_BxTxI, c_B), g_BxTxO, preferred_element_type=_F32)
  return jnp.einsum("bti,bto->io", a_BxTxI, _scaled(g_BxTxO, c_B), preferred_element_type=_F32)


def bias_weighted_grad(g_BxTxO, c_B):
  return jnp.einsum("bto,b->o", g_BxTxO.astype(_F32), c_B.astype(_F32))


def scale_weighted_grad(xhat_BxTxD, g_BxTxD, c_B):
  return jnp.einsum("btd,btd->d", _scaled(xhat_BxTxD, c_B), g_BxTxD, preferred_element_type=_F32)


def embedding_weighted_grad(tokens_BxT, g_BxTxD, c_B, vocab_size: int):
  d = g_BxTxD.shape[-1]
  rows_NxD = _scaled(g_BxTxD, c_B).reshape(-1, d)
  return jax.ops.segment_sum(rows_NxD, tokens_BxT.reshape(-1), num_segments=vocab_size)
