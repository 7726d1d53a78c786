"""LM head over token tiles: each tile's full-vocabulary logits in one GEMM (bf16 operands, float32 accumulation)
with a recomputing custom VJP; lm_head's model.lm_head="token_tiles" path."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Shape letters as in lm_head.py; N tokens, R tokens per tile, M tiles (N padded to M * R).
#
# Why token tiles (beside lm_head's vocabulary chunks): a tile's logits are one [R, D] x [D, V] GEMM instead of
# V / C small sequential ones, the shape a GPU's matmul units like; the price is R * V float32 logits per tile
# (R = 1024 at the 0.5B vocabulary: 0.62 GB) and, in the backward, one read-modify-write of the [V, D] float32
# gradient accumulator per tile. R >= N is one tile: full logits, but with this VJP's bf16 backward GEMMs (the
# plain path's autodiff backward multiplies float32 logit gradients, so its GEMMs run in float32).
_F32 = jnp.float32


def _tile_logits(x_RxD, w, precision, vocab_major: bool):
  spec = "rd,vd->rv" if vocab_major else "rd,dv->rv"
  return jnp.einsum(spec, x_RxD, w, preferred_element_type=_F32, precision=precision)


def _tile_stats(x_RxD, w, y_R, precision, vocab_major):
  """(logp_R, ent_R, lse_R) of one tile, float32."""
  z_RxV = _tile_logits(x_RxD, w, precision, vocab_major)
  lse_R = jax.nn.logsumexp(z_RxV, axis=-1)
  logz_RxV = z_RxV - lse_R[:, None]
  logp_R = jnp.take_along_axis(logz_RxV, y_R[:, None], axis=-1)[:, 0]
  return logp_R, -jnp.sum(jnp.exp(logz_RxV) * logz_RxV, axis=-1), lse_R


def _tiles(x_NxD, y_N, r: int):
  """x and y padded to whole tiles: [M, R, D], [M, R] (padded rows: zeros, target 0; dropped after);
  R = min(r, N)."""
  n = x_NxD.shape[0]
  r = min(r, n)
  m = -(-n // r)
  pad = m * r - n
  x = jnp.pad(x_NxD, ((0, pad), (0, 0))).reshape(m, r, -1)
  return x, jnp.pad(y_N, (0, pad)).reshape(m, r)


def _stats(x_NxD, w, y_N, r, precision, vocab_major):
  n = x_NxD.shape[0]
  w = w.astype(x_NxD.dtype)  # once, not per tile: the GEMMs read bf16 weights when the compute is bf16
  x_MxRxD, y_MxR = _tiles(x_NxD, y_N, r)
  out = jax.lax.map(lambda xy: _tile_stats(xy[0], w, xy[1], precision, vocab_major), (x_MxRxD, y_MxR))
  return tuple(v.reshape(-1)[:n] for v in out)


def recomputing_vjp(stats, bwd):
  """(logp_N, ent_N) = f(x_NxD, w, y_N, a, b, c) (three static arguments) as a custom VJP that keeps only x, w,
  y, lse_N and ent_N for `bwd(a, b, c, residuals, cotangents)`, which recomputes the logits: both recomputing
  heads (these tiles, lm_head's vocabulary chunks). `stats` returns (logp_N, ent_N, lse_N)."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
  def logp_ent(x_NxD, w, y_N, a, b, c):
    return stats(x_NxD, w, y_N, a, b, c)[:2]

  def fwd(x_NxD, w, y_N, a, b, c):
    logp_N, ent_N, lse_N = stats(x_NxD, w, y_N, a, b, c)
    return (logp_N, ent_N), (x_NxD, w, y_N, lse_N, ent_N)

  logp_ent.defvjp(fwd, bwd)
  return logp_ent


def _bwd(r, precision, vocab_major, residuals, cotangents):
  """dz = dlogp (onehot - p) - dent p (log p + ent) per tile, cast to the compute dtype for both GEMMs."""
  x_NxD, w, y_N, lse_N, ent_N = residuals
  n, cdt = x_NxD.shape[0], x_NxD.dtype
  wc = w.astype(cdt)
  x_MxRxD, y_MxR = _tiles(x_NxD, y_N, r)
  m, r = x_MxRxD.shape[:2]
  pad = lambda v_N: jnp.pad(v_N.astype(_F32), (0, m * r - n)).reshape(m, r)
  per_tile = (x_MxRxD, y_MxR, pad(lse_N), pad(ent_N), pad(cotangents[0]), pad(cotangents[1]))

  def body(dw, tile):
    x_RxD, y_R, lse_R, ent_R, dlogp_R, dent_R = tile
    logz_RxV = _tile_logits(x_RxD, wc, precision, vocab_major) - lse_R[:, None]
    p_RxV = jnp.exp(logz_RxV)
    onehot_RxV = jax.nn.one_hot(y_R, p_RxV.shape[-1], dtype=_F32)
    dz_RxV = (dlogp_R[:, None] * (onehot_RxV - p_RxV)
              - dent_R[:, None] * p_RxV * (logz_RxV + ent_R[:, None])).astype(cdt)
    dx_RxD = jnp.einsum("rv,vd->rd" if vocab_major else "rv,dv->rd", dz_RxV, wc, preferred_element_type=_F32,
                        precision=precision)
    dw_tile = jnp.einsum("rv,rd->vd" if vocab_major else "rv,rd->dv", dz_RxV, x_RxD,
                         preferred_element_type=_F32, precision=precision)
    return dw + dw_tile, dx_RxD.astype(cdt)

  dw, dx_MxRxD = jax.lax.scan(body, jnp.zeros(w.shape, _F32), per_tile)
  return dx_MxRxD.reshape(-1, x_NxD.shape[1])[:n], dw.astype(w.dtype), None


# logp_ent(x_NxD, w, y_N, r, precision, vocab_major): (logp_N, ent_N) float32 of the targets y_N, R = r tokens
# per tile; the backward recomputes each tile's logits.
logp_ent = recomputing_vjp(_stats, _bwd)


