"""Memory-bounded per-sequence squared gradient norms: formed layer by layer in one backward, then any backward."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from vcpo_jax.learner import grad_norms as G
from vcpo_jax.learner import op_norms
from vcpo_jax.learner.norm_taps import Taps
from vcpo_jax.model import lm_head
from vcpo_jax.model import transformer as M

# Shape letters: B batch, T length, D hidden, L layers.
# One forward of the model with capture=Taps(mode) (learner.norm_taps) gives log-probs and a VJP closure over
# that forward's residuals, i.e. exactly what an ordinary backward keeps (under remat: what the policy keeps).
#  1. VJP of sum_t m_t log pi with respect to the taps: each parametrised op turns its own a and g into
#     [B] squared norms as the backward passes it, so nothing per layer outlives its layer. Left out of the
#     taps and added from small tensors afterwards: the embedding (output-gradient [B, T, D], one zero
#     perturbation, as book-keeping does), the LM head (from the final hidden states [B, T, D]) and, when
#     tied, their cross term.
#  2. The caller forms its coefficients from the norms and asks for the VJP of any cotangent on the log-probs
#     (the registered loss's dloss/dlogp): an ordinary backward, reusing the same forward.
# So memory is an ordinary step's plus [L, B] floats, two [B, T, D] tensors and, inside one layer's backward,
# its ops' a and g held until their norm rules ran; on CPU with bf16 compute also the bf16 residual stack
# during the second backward, as XLA-CPU works on an f32 copy of it (measured: benchmarks/cpu/bench_bounded.py,
# results.md); compute is one forward and two backwards (the first without weight gradients: XLA drops them).
_F32 = jnp.float32


def _zero_taps(cfg: M.ModelConfig, taps: Taps, tokens_BxT, positions_BxT, params=None, adapter=None):
  if adapter is None:
    shapes = jax.eval_shape(lambda: M.Transformer(cfg, capture=taps, head=False).init(
        jax.random.PRNGKey(0), tokens_BxT, positions_BxT, None))
  else:  # the adapters' taps exist only where the "lora" collection is given
    shapes = jax.eval_shape(lambda: M.Transformer(cfg, capture=taps, head=False).apply(
        M.variables(params, adapter), tokens_BxT, positions_BxT, None,
        mutable=["norm_taps", "perturbations"])[1])
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
  return zeros(shapes["norm_taps"]), zeros(shapes["perturbations"])


def _head(params, cfg: M.ModelConfig):
  """(head kernel, vocab_major): a tied head is the embedding itself, read vocab-major by model.lm_head, so
  no [D, V] transposed copy of it is made (nor of its gradient)."""
  if cfg.tie_word_embeddings:
    return params["embed_tokens"], True
  return params["lm_head"]["kernel"], False


def _head_sq_norms(params, cfg: M.ModelConfig, tokens_BxT, mask_BxT, x_BxTxD, g_embed_BxTxD, mode: str):
  """{leaf: sq_B} of the embedding (+ tied head and cross term) and the untied head (model.lm_head's terms)."""
  w, vocab_major = _head(params, cfg)
  lse_BxT = lm_head.logsumexp(x_BxTxD, w, cfg.precision, cfg.head_chunk, vocab_major=vocab_major)
  head = dict(precision=cfg.precision, chunk=cfg.head_chunk, lse_BxT=lse_BxT, vocab_major=vocab_major)
  head_sq_B = lm_head.head_sq_norms(x_BxTxD, w, tokens_BxT, mask_BxT, mode, **head)
  embed_sq_B = op_norms.embedding_sq_norms(tokens_BxT, g_embed_BxTxD, cfg.vocab_size, mode)
  if not cfg.tie_word_embeddings:
    return {"embed_tokens": embed_sq_B, "lm_head/kernel": head_sq_B}
  cross_B = lm_head.tied_cross_terms(tokens_BxT, g_embed_BxTxD, x_BxTxD, w, mask_BxT, **head)
  return {"embed_tokens": jnp.maximum(embed_sq_B + head_sq_B + 2.0 * cross_B, 0.0)}


def sq_norms_and_vjp(params, cfg: M.ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None, key_mask_BxT=None,
                     *, mode: str = "auto", adapter=None):
  """(sq_norms_B, aux, grad_of): ||grad_theta sum_t m_t log pi(y_t)||^2 per sequence, over all parameters;
  with an adapter (model.lora) theta is the adapter alone: only its ops take taps and grad_of gives its
  gradient (params frozen: no embedding or LM-head terms).

  aux: logp_BxT, ent_BxT (masked, as model.token_logprobs_and_entropy) and leaf_sq_norms {"a/b/kernel": sq_B}
  (sums to sq_norms_B). grad_of(dlogp_BxT) -> the parameter gradient of sum(dlogp_BxT * logp_BxT) (param
  dtypes), by an ordinary backward through the same forward's residuals.
  """
  op_norms.check_mode(mode)
  if positions_BxT is None:
    positions_BxT = M._default_positions(tokens_BxT)
  attn_mask = M.attention_mask(positions_BxT, key_mask_BxT)
  taps = Taps(mode, adapter_only=adapter is not None)
  taps0, perts0 = _zero_taps(cfg, taps, tokens_BxT, positions_BxT, params, adapter)
  trainable = params if adapter is None else adapter

  def forward(t, taps_tree, perts):
    p, ad = (t, None) if adapter is None else (params, t)
    x_BxTxD, _ = M.Transformer(cfg, capture=taps, head=False).apply(
        {**M.variables(p, ad), "norm_taps": taps_tree, "perturbations": perts}, tokens_BxT, positions_BxT,
        attn_mask)
    w, vocab_major = _head(p, cfg)
    logp_BxT, ent_BxT = lm_head.token_logprobs_and_entropy(
        x_BxTxD, w, tokens_BxT, mask_BxT, vocab_major=vocab_major, **cfg.head_logprob_args())
    return (logp_BxT, ent_BxT), x_BxTxD

  (logp_BxT, ent_BxT), vjp, x_BxTxD = jax.vjp(forward, trainable, taps0, perts0, has_aux=True)
  # logp is already masked, so a unit cotangent is the gradient of sum_t m_t log pi for every row at once.
  _, tap_sq, d_perts = vjp((jnp.ones_like(logp_BxT), jnp.zeros_like(ent_BxT)))
  x_BxTxD = jax.lax.stop_gradient(x_BxTxD)
  leaf_sq = {}
  for path, sq in traverse_util.flatten_dict(tap_sq).items():
    # Under scan a tap is [L, B] (one row per layer): that leaf's norm sums its layers' contributions.
    leaf_sq["/".join(path)] = jnp.maximum(jnp.sum(sq, axis=0) if sq.ndim == 2 else sq, 0.0).astype(_F32)
  if adapter is None:
    leaf_sq.update(_head_sq_norms(params, cfg, tokens_BxT, mask_BxT, x_BxTxD, d_perts["embed_outputs"], mode))
  missing = {"/".join(p) for p in traverse_util.flatten_dict(trainable)} - set(leaf_sq)
  if missing:  # a parameter without a tap would silently drop out of every norm
    raise ValueError(f"bounded_norms: no per-sequence norm for parameter(s) {sorted(missing)}")
  sq_B = sum(leaf_sq.values())

  def backward(dlogp_BxT):
    grads, _, _ = vjp((dlogp_BxT.astype(logp_BxT.dtype), jnp.zeros_like(ent_BxT)))
    return grads

  def grad_of(dlogp_BxT):
    # Why a cond: the ordinary backward's stacked gradient buffers (zeros written layer by layer, ~ the size
    # of the layer parameters) depend on nothing, so XLA's scheduler may allocate them before the norms
    # backward and keep them through it (measured: 2.0 GB of the live peak at the 0.5B shape, B=16 x 1024).
    # Inside a branch they exist only while it runs. The predicate is exact, not a guard: an all-zero
    # cotangent has an all-zero gradient, so that branch returns zeros without a backward.
    nonzero = jnp.any(dlogp_BxT != 0)
    zeros = lambda _: jax.tree.map(jnp.zeros_like, trainable)
    return jax.lax.cond(nonzero, backward, zeros, dlogp_BxT)

  return sq_B, {"logp_BxT": logp_BxT, "ent_BxT": ent_BxT, "leaf_sq_norms": leaf_sq}, grad_of


def per_sequence_sq_norms(params, cfg: M.ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None,
                          key_mask_BxT=None, *, mode: str = "auto", adapter=None):
  """Same contract as grad_norms.per_sequence_sq_norms, in bounded memory."""
  sq_B, aux, _ = sq_norms_and_vjp(params, cfg, tokens_BxT, mask_BxT, positions_BxT, key_mask_BxT, mode=mode,
                                  adapter=adapter)
  return sq_B, aux


def per_sequence_sq_norms_and_grad(params, cfg: M.ModelConfig, tokens_BxT, mask_BxT, coef_fn: G.CoefFn,
                                   positions_BxT=None, key_mask_BxT=None, *, mode: str = "auto", adapter=None):
  """Same contract as grad_norms.per_sequence_sq_norms_and_grad: norms, then the ordinary backward of
  sum_i c_i sum_t m_t log pi(y_t) through the same forward."""
  sq_B, aux, grad_of = sq_norms_and_vjp(params, cfg, tokens_BxT, mask_BxT, positions_BxT, key_mask_BxT,
                                        mode=mode, adapter=adapter)
  c_B, extra = coef_fn(sq_B, aux["logp_BxT"], aux["ent_BxT"])
  c_B = jax.lax.stop_gradient(c_B).astype(_F32)
  grads = grad_of(jnp.broadcast_to(c_B[:, None], aux["logp_BxT"].shape))
  return grads, sq_B, {**aux, "coef_B": c_B, "extra": extra}
