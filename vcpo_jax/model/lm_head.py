"""LM head: token log-probs, entropies and the head's per-sequence gradient terms from final hidden states,
computed over vocabulary chunks so that [tokens, vocab] float32 logits never exist at once."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax.model import lm_head_plain as plain
from vcpo_jax.model import lm_head_tiles as tiles

# Shape letters: B batch, T/S length, D hidden, V vocab, C vocab chunk, N tokens (B*T). Position t's logits
# predict token t+1: logp[:, t] is log p(tokens[:, t] | tokens[:, :t]) and logp[:, 0] = 0, as in
# model.token_logprobs. The head kernel w_DxV is lm_head/kernel, or embed_tokens.T when tied.
#
# Why chunks over the vocabulary (not over tokens): each chunk's [tokens, C] logits are recomputed, used and
# dropped; the running per-token statistics (max, sum of exp, sum of exp * logit) are [tokens] vectors, the
# backward's dx accumulator is [tokens, D] (small next to [D, V]) and each column of dW is written exactly
# once. Token chunks would instead re-read and re-write the whole [D, V] float32 dW accumulator once per
# chunk. The per-sequence Gram terms of the ghost norms are sums over the vocabulary, i.e. over chunks.
# Temporaries are ~C * 4 bytes * a few per token, independent of V.
#
# vocab_major=True: the head argument is given as [V, D] (the tied embedding itself, not embed.T); chunks are
# then contiguous rows and its gradient comes back as [V, D], with no [D, V] transposed copy of either.
#
# chunk: vocabulary columns per chunk. None -> DEFAULT_CHUNK; 0 -> the plain formulation (full logits; the
# reference the tests compare with); >= V -> one chunk. Chunks have equal size: the last one starts at V - C
# and owns only the columns no earlier chunk had, so V need not be a multiple of C (no padded copy of w).
# Default 2048, measured (head_grad_temporaries, Qwen2.5-0.5B head D=896 V=151936, B=8 T=1024, CPU compile):
# XLA temporaries of grad(sum logp) 8.2 / 16.4 / 32.8 KB per token at C = 1024 / 2048 / 4096, against 1.21 MB
# per token for the plain path; 2048-wide chunk matmuls ([tokens, D] x [D, 2048]) stay large enough to keep
# a GPU's matmul units busy (75 scan steps at that vocabulary; GPU speed not measured here).
DEFAULT_CHUNK = 2048
_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def vocab_chunk(chunk, vocab_size: int) -> int:
  """Columns per chunk for this vocabulary (0: plain path), or a ValueError naming the bad value."""
  chunk = DEFAULT_CHUNK if chunk is None else chunk
  if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 0:
    raise ValueError(f"lm_head chunk must be an int >= 0 (0: the plain path), got chunk={chunk!r}")
  return min(int(chunk), vocab_size)


def _chunk_starts(vocab_size: int, c: int):
  """Per chunk: first column read (start) and first column owned (lo); static, scanned over."""
  lo = np.arange(-(-vocab_size // c)) * c
  return jnp.asarray(np.minimum(lo, vocab_size - c), jnp.int32), jnp.asarray(lo, jnp.int32)


def _vaxis(vocab_major: bool) -> int:
  return 0 if vocab_major else 1


def _scan_chunks(body, init, w, c: int, vaxis: int):
  return jax.lax.scan(body, init, _chunk_starts(w.shape[vaxis], c))


def _chunk_logits(x_NxD, w, start, lo, c: int, precision, vaxis: int):
  """(z_NxC float32 logits of the chunk, its columns' ids and which it owns (both [1.., C]), w_DxC)."""
  w_chunk = jax.lax.dynamic_slice_in_dim(w, start, c, axis=vaxis).astype(x_NxD.dtype)
  w_DxC = w_chunk if vaxis == 1 else w_chunk.T
  z = jnp.einsum("...d,dc->...c", x_NxD, w_DxC, preferred_element_type=_F32, precision=precision)
  cols_C = (start + jnp.arange(c, dtype=jnp.int32)).reshape((1,) * (z.ndim - 1) + (c,))  # ranks match z's
  return z, cols_C, cols_C >= lo, w_DxC


def _stats(x_NxD, w, y_N, c: int, precision, vaxis: int):
  """(logp_N, ent_N, lse_N) of the targets y by an online log-sum-exp over the vocabulary chunks.

  Carried per token: running max m, s = sum exp(z - m), u = sum exp(z - m) (z - m), and z[y]; then
  lse = m + log s and entropy = lse - E[z] = log s - u / s (two non-negative terms: no cancellation)."""
  lead = x_NxD.shape[:-1]

  def body(carry, starts):
    m, s, u, zy = carry
    z, cols, owned, _ = _chunk_logits(x_NxD, w, starts[0], starts[1], c, precision, vaxis)
    new_m = jnp.maximum(m, jnp.max(jnp.where(owned, z, -jnp.inf), axis=-1))
    shifted = jnp.where(owned, z - new_m[..., None], -jnp.inf)
    e = jnp.exp(shifted)
    a, dm = jnp.exp(m - new_m), m - new_m
    s_new = s * a + jnp.sum(e, axis=-1)
    u_new = a * (u + s * dm) + jnp.sum(e * jnp.where(owned, shifted, 0.0), axis=-1)
    zy = zy + jnp.sum(jnp.where(owned & (cols == y_N[..., None]), z, 0.0), axis=-1)
    return (new_m, s_new, u_new, zy), None

  # The running max starts at the lowest finite float (not -inf) so that s * (m - new_m) is 0, not NaN.
  init = (jnp.full(lead, jnp.finfo(_F32).min, _F32), jnp.zeros(lead, _F32), jnp.zeros(lead, _F32),
          jnp.zeros(lead, _F32))
  (m, s, u, zy), _ = _scan_chunks(body, init, w, c, vaxis)
  lse = m + jnp.log(s)
  return zy - lse, jnp.log(s) - u / s, lse


def _logp_ent_bwd(c, precision, vaxis, residuals, cotangents):
  """Recomputes each chunk's logits: dz = dlogp (onehot - p) - dent p (log p + ent)."""
  x_NxD, w, y_N, lse_N, ent_N = residuals
  dlogp_N, dent_N = (ct.astype(_F32) for ct in cotangents)
  cdt = x_NxD.dtype

  def body(carry, starts):
    dx_NxD, dw = carry
    start, lo = starts
    z, cols, owned, w_DxC = _chunk_logits(x_NxD, w, start, lo, c, precision, vaxis)
    logz = jnp.where(owned, z - lse_N[:, None], 0.0)
    p = jnp.where(owned, jnp.exp(logz), 0.0)
    onehot = (owned & (cols == y_N[:, None])).astype(_F32)
    dz = (dlogp_N[:, None] * (onehot - p) - dent_N[:, None] * p * (logz + ent_N[:, None])).astype(cdt)
    dx_NxD = dx_NxD + jnp.einsum("nc,dc->nd", dz, w_DxC, preferred_element_type=_F32, precision=precision)
    dw_DxC = jnp.einsum("nd,nc->dc", x_NxD, dz, preferred_element_type=_F32, precision=precision)
    # Non-owned columns of the overlapping last chunk get dz = 0: adding keeps the earlier chunk's values.
    return (dx_NxD, _add_chunk(dw, dw_DxC, start, c, vaxis)), None

  init = (jnp.zeros(x_NxD.shape, _F32), jnp.zeros(w.shape, w.dtype))
  (dx_NxD, dw), _ = _scan_chunks(body, init, w, c, vaxis)
  return dx_NxD.astype(x_NxD.dtype), dw, None


# _logp_ent(x_NxD, w, y_N, c, precision, vaxis): (logp_N, ent_N) over vocabulary chunks of c columns.
_logp_ent = tiles.recomputing_vjp(_stats, _logp_ent_bwd)


def _add_chunk(dw, dw_DxC, start, c: int, vaxis: int):
  """dw[chunk] += dw_DxC, in dw's layout. Non-owned columns of the overlapping last chunk carry 0, so
  adding keeps the earlier chunk's values (each column is written once in effect)."""
  old = jax.lax.dynamic_slice_in_dim(dw, start, c, axis=vaxis)
  new = old + (dw_DxC if vaxis == 1 else dw_DxC.T).astype(dw.dtype)
  return jax.lax.dynamic_update_slice_in_dim(dw, new, start, axis=vaxis)


def token_logprobs_and_entropy(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision=_HIGHEST, chunk=None, *,
                               vocab_major: bool = False, token_tile: int = 0):
  """(logp_BxT, ent_BxT), masked, float32: log p(tokens[t] | :t) and the entropy of that distribution.

  Differentiable wrt x and w (custom VJP: the backward recomputes chunk logits; it keeps only x, w, the
  targets and two floats per token). token_tile > 0: over tiles of that many tokens with full-vocabulary
  logits instead (lm_head_tiles; `chunk` is then unused)."""
  vaxis = _vaxis(vocab_major)
  c = vocab_chunk(chunk, w_DxV.shape[vaxis])
  if isinstance(token_tile, bool) or not isinstance(token_tile, (int, np.integer)) or token_tile < 0:
    raise ValueError(f"lm_head token_tile must be an int >= 0 (0: vocabulary chunks), got token_tile={token_tile!r}")
  if c == 0 and not token_tile:
    return plain.logprobs_and_entropy(x_BxTxD, _as_DxV(w_DxV, vaxis), tokens_BxT, mask_BxT, precision)
  b, t, d = x_BxTxD.shape
  x_NxD, y_N = x_BxTxD.reshape(b * t, d), plain.next_tokens(tokens_BxT).reshape(-1)
  if token_tile:
    logp_N, ent_N = tiles.logp_ent(x_NxD, w_DxV, y_N, int(token_tile), precision, vocab_major)
  else:
    logp_N, ent_N = _logp_ent(x_NxD, w_DxV, y_N, c, precision, vaxis)
  pad, m = jnp.zeros((b, 1), _F32), mask_BxT.astype(_F32)
  shift = lambda v_N: jnp.concatenate([pad, v_N.reshape(b, t)[:, :-1]], axis=1) * m
  return shift(logp_N), shift(ent_N)


def _as_DxV(w, vaxis: int):
  return w if vaxis == 1 else w.T


def logsumexp(x_BxTxD, w_DxV, precision=_HIGHEST, chunk=None, *, vocab_major: bool = False):
  """lse_BxT of every position's logits (the per-sequence terms below take it to skip their own pass)."""
  vaxis = _vaxis(vocab_major)
  c = vocab_chunk(chunk, w_DxV.shape[vaxis]) or w_DxV.shape[vaxis]
  return _stats(x_BxTxD, w_DxV, jnp.zeros(x_BxTxD.shape[:-1], jnp.int32), c, precision, vaxis)[2]


def head_grad_temporaries(b: int, t: int, d: int, v: int, chunk=None, tied: bool = True, dtype=_F32,
                          param_dtype=_F32) -> dict:
  """XLA temporaries of jit(grad(sum logp)) wrt (x, head) on abstract inputs: compile only, nothing allocated
  (a benchmark hook: the Qwen2.5-0.5B head is b, t, 896, 151936). tied: the head is an embedding's transpose."""
  import time
  s = jax.ShapeDtypeStruct
  head = s((v, d) if tied else (d, v), param_dtype)

  def loss(x, head, tokens, mask):  # tied: the embedding is passed as it is (vocab_major)
    return jnp.sum(token_logprobs_and_entropy(x, head, tokens, mask, chunk=chunk, vocab_major=tied)[0])

  start = time.perf_counter()
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
      s((b, t, d), dtype), head, s((b, t), jnp.int32), s((b, t), _F32)).compile()
  seconds = time.perf_counter() - start
  temp = int(compiled.memory_analysis().temp_size_in_bytes)
  return {"temp_bytes": temp, "temp_bytes_per_token": temp / (b * t), "compile_s": seconds,
          "chunk": vocab_chunk(chunk, v), "tied": tied}


# ---------------------------------------------------------------------------------------------------------
# Per-sequence terms of the head-kernel gradient. g[b, t] = d(sum_s m_s logp_s)/d logits[b, t]
# = m'_t (onehot(nxt_t) - p_t), never formed whole: each chunk's slice g[..., chunk] is.
# ---------------------------------------------------------------------------------------------------------

def _chunk_p(x_BxTxD, w, lse_BxT, starts, c, precision, vaxis):
  z, cols, owned, _ = _chunk_logits(x_BxTxD, w, starts[0], starts[1], c, precision, vaxis)
  return jnp.where(owned, jnp.exp(jnp.where(owned, z - lse_BxT[..., None], 0.0)), 0.0), cols, owned


def _chunk_g(x_BxTxD, w, nxt_BxT, mp_BxT, lse_BxT, starts, c, precision, vaxis):
  p, cols, owned = _chunk_p(x_BxTxD, w, lse_BxT, starts, c, precision, vaxis)
  return ((owned & (cols == nxt_BxT[..., None])).astype(_F32) - p) * mp_BxT[..., None]


def _prob_at(x_BxSxD, w, ids_BxT, lse_BxS, precision, vaxis):
  """q[b, s, t] = p_s[ids_t] = exp(x_s . w[:, ids_t] - lse_s): the probabilities a Gram term needs."""
  w_ids = jnp.take(w, ids_BxT, axis=vaxis).astype(x_BxSxD.dtype)   # [B, T, D] or [D, B, T]
  spec = "bsd,btd->bst" if vaxis == 0 else "bsd,dbt->bst"
  return jnp.exp(jnp.einsum(spec, x_BxSxD, w_ids, preferred_element_type=_F32, precision=precision)
                 - lse_BxS[..., None])


def _prepare(x_BxTxD, w, tokens_BxT, mask_BxT, precision, chunk, lse_BxT, vocab_major):
  vaxis = _vaxis(vocab_major)
  c = vocab_chunk(chunk, w.shape[vaxis])
  if c and lse_BxT is None:
    lse_BxT = logsumexp(x_BxTxD, w, precision, c, vocab_major=vocab_major)
  return c, vaxis, plain.next_tokens(tokens_BxT), plain.shift_mask(mask_BxT), lse_BxT


def head_sq_norms(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, mode: str = "auto", precision=_HIGHEST, chunk=None,
                  lse_BxT=None, *, vocab_major: bool = False):
  """||x_i^T g_i||_F^2 per sequence: the squared norm of sequence i's head-kernel gradient.

  ghost: <x_i x_i^T, g_i g_i^T> with g_t.g_s = m'_t m'_s (delta(nxt_t = nxt_s) - p_t[nxt_s] - p_s[nxt_t]
  + p_t.p_s), p_t.p_s summed over chunks; explicit: ||x_i^T g_i[:, chunk]||^2 summed over chunks.
  lse_BxT (optional, logsumexp of the same x, w) saves one pass over the vocabulary."""
  c, vaxis, nxt, mp, lse = _prepare(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision, chunk, lse_BxT,
                                    vocab_major)
  if c == 0:
    return plain.head_sq_norms(x_BxTxD, _as_DxV(w_DxV, vaxis), tokens_BxT, mask_BxT, mode, precision)
  b, t, d = x_BxTxD.shape
  x32 = x_BxTxD.astype(_F32)
  if plain.use_ghost(mode, t, d, w_DxV.shape[vaxis]):
    def body(pp_BxTxS, starts):
      p, _, _ = _chunk_p(x_BxTxD, w_DxV, lse, starts, c, precision, vaxis)
      return pp_BxTxS + jnp.einsum("btc,bsc->bts", p, p, preferred_element_type=_F32), None
    pp_BxTxS, _ = _scan_chunks(body, jnp.zeros((b, t, t), _F32), w_DxV, c, vaxis)
    q_BxTxS = _prob_at(x_BxTxD, w_DxV, nxt, lse, precision, vaxis)
    same = (nxt[:, :, None] == nxt[:, None, :]).astype(_F32)
    gram_g = (same - q_BxTxS - jnp.swapaxes(q_BxTxS, 1, 2) + pp_BxTxS) * mp[:, :, None] * mp[:, None, :]
    gram_x = jnp.einsum("btd,bsd->bts", x32, x32, preferred_element_type=_F32)
    return jnp.maximum(jnp.sum(gram_x * gram_g, axis=(1, 2)), 0.0)

  def body(sq_B, starts):
    g = _chunk_g(x_BxTxD, w_DxV, nxt, mp, lse, starts, c, precision, vaxis)
    dw_BxDxC = jnp.einsum("btd,btc->bdc", x32, g, preferred_element_type=_F32)
    return sq_B + jnp.sum(jnp.square(dw_BxDxC), axis=(1, 2)), None
  return _scan_chunks(body, jnp.zeros((b,), _F32), w_DxV, c, vaxis)[0]


def head_weighted_grad(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, c_B, precision=_HIGHEST, chunk=None,
                       lse_BxT=None, *, vocab_major: bool = False):
  """sum_i c_i x_i^T g_i: the head-kernel gradient of sum_i c_i sum_t m_t logp_t (c constant), float32, in
  the head argument's layout ([D, V]; [V, D] with vocab_major)."""
  c, vaxis, nxt, mp, lse = _prepare(x_BxTxD, w_DxV, tokens_BxT, mask_BxT, precision, chunk, lse_BxT,
                                    vocab_major)
  if c == 0:
    dw_DxV = plain.head_weighted_grad(x_BxTxD, _as_DxV(w_DxV, vaxis), tokens_BxT, mask_BxT, c_B, precision)
    return _as_DxV(dw_DxV, vaxis)
  xc_BxTxD = x_BxTxD.astype(_F32) * c_B.astype(_F32)[:, None, None]

  def body(dw, starts):
    g = _chunk_g(x_BxTxD, w_DxV, nxt, mp, lse, starts, c, precision, vaxis)
    dw_DxC = jnp.einsum("btd,btc->dc", xc_BxTxD, g, preferred_element_type=_F32)
    return _add_chunk(dw, dw_DxC, starts[0], c, vaxis), None
  return _scan_chunks(body, jnp.zeros(w_DxV.shape, _F32), w_DxV, c, vaxis)[0]


def tied_cross_terms(tokens_BxT, g_embed_BxTxD, x_BxSxD, w_DxV, mask_BxT, precision=_HIGHEST, chunk=None,
                     lse_BxT=None, *, vocab_major: bool = False):
  """<E_i, H_i^T> between sequence i's embedding gradient (row scatter of g_embed by token id) and its head
  gradient: sum_{t,s} g_head[s, id_t] <g_embed_t, x_s>, g_head[s, id_t] = m'_s (delta(nxt_s = id_t)
  - p_s[id_t]) (only the log-sum-exp pass touches the whole vocabulary)."""
  c, vaxis, nxt, mp, lse = _prepare(x_BxSxD, w_DxV, tokens_BxT, mask_BxT, precision, chunk, lse_BxT,
                                    vocab_major)
  if c == 0:
    return plain.tied_cross_terms(tokens_BxT, g_embed_BxTxD, x_BxSxD, _as_DxV(w_DxV, vaxis), mask_BxT,
                                   precision)
  q_BxSxT = _prob_at(x_BxSxD, w_DxV, tokens_BxT, lse, precision, vaxis)
  same_BxSxT = (nxt[:, :, None] == tokens_BxT[:, None, :]).astype(_F32)
  gh_BxSxT = (same_BxSxT - q_BxSxT) * mp[:, :, None]
  ex_BxSxT = jnp.einsum("btd,bsd->bst", g_embed_BxTxD.astype(_F32), x_BxSxD.astype(_F32),
                        preferred_element_type=_F32)
  return jnp.sum(gh_BxSxT * ex_BxSxT, axis=(1, 2))
