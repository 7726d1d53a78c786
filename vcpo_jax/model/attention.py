"""Grouped-query attention kernels: jax.nn.dot_product_attention (XLA or cuDNN) and the explicit einsum path."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from vcpo_jax.model import attention_tpu
from vcpo_jax.parallel import target

# Shape letters: B batch, T query length, S key length, H query heads, K kv heads, G = H // K, E head dim.
# model.attention picks one: "auto" = cuDNN flash attention where supported (GPU, bf16/fp16, head dim a
# multiple of 8 <= 128, even lengths), splash attention on a TPU where supported (attention_tpu.py), else
# jax.nn.dot_product_attention with implementation=None (XLA chooses); "xla" = always the latter; "cudnn" =
# cuDNN, falling back to the einsum path where unsupported; "splash" = the splash kernel (in Pallas'
# interpreter off a TPU: the CPU tests), falling back to XLA where unsupported; "einsum" = the reference path.
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash", "einsum")
_warned: set = set()


def einsum_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, precision, dtype):
  """Softmax(q k^T / sqrt(E)) v in float32 scores; a fully masked query row gets the mean of v (not NaN)."""
  B, T, H, E = q_BxTxHxE.shape
  K = k_BxSxKxE.shape[2]
  q_BxTxKxGxE = q_BxTxHxE.reshape(B, T, K, H // K, E)
  scores = jnp.einsum("btkge,bske->bkgts", q_BxTxKxGxE, k_BxSxKxE.astype(q_BxTxHxE.dtype),
                      preferred_element_type=jnp.float32, precision=precision) * (1.0 / float(E) ** 0.5)
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgts,bske->btkge", probs, v_BxSxKxE.astype(dtype),
                   preferred_element_type=jnp.float32, precision=precision).astype(dtype)
  return out.reshape(B, T, H, E)


def cudnn_unsupported(q_BxTxHxE, k_BxSxKxE) -> str | None:
  """Why cuDNN flash attention cannot run these inputs here (None when it can)."""
  platform = target.current().platform
  if platform != "gpu":
    return f"target platform is {platform!r}, not gpu"
  if q_BxTxHxE.dtype not in (jnp.bfloat16, jnp.float16):
    return f"compute dtype {q_BxTxHxE.dtype} (cuDNN needs bfloat16 or float16)"
  E = q_BxTxHxE.shape[-1]
  if E % 8 or E > 128:
    return f"head_dim={E} (cuDNN needs a multiple of 8, <= 128)"
  if q_BxTxHxE.shape[1] % 2 or k_BxSxKxE.shape[1] % 2:  # the mask travels as a bias: even lengths only
    return f"odd query/key length {q_BxTxHxE.shape[1]}/{k_BxSxKxE.shape[1]}"
  return None


def _warn_once(why: str):
  if why not in _warned:
    _warned.add(why)
    logging.warning("model.attention='cudnn' unsupported (%s): using the einsum path", why)


def attend(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, *, implementation: str, precision, dtype,
           is_causal: bool = False):
  """[B, T, H, E] attention output in `dtype`; mask_BxTxS True where query t may see key s.

  is_causal: the caller promises mask_BxTxS is exactly causal by index (key s <= query t, T == S, every key
  valid), as in the learner's forward over right-padded rows; jax.nn's kernels then get is_causal=True
  instead of the mask (cuDNN needs no [B, 1, T, S] bias, whose gradient jax <= 0.11.0 also computes)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"model.attention must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if is_causal and q_BxTxHxE.shape[1] != k_BxSxKxE.shape[1]:
    raise ValueError(f"is_causal attention needs T == S, got {q_BxTxHxE.shape[1]} queries and "
                     f"{k_BxSxKxE.shape[1]} keys")
  k, v = k_BxSxKxE.astype(dtype), v_BxSxKxE.astype(dtype)
  q = q_BxTxHxE.astype(dtype)
  if attention_tpu.chosen(implementation, q, k):
    return attention_tpu.splash_attention(q, k, v, mask_BxTxS, dtype, interpret=target.current().platform != "tpu")
  impl = None
  if implementation in ("auto", "cudnn"):
    why = cudnn_unsupported(q, k)
    if why is None:
      impl = "cudnn"
    elif implementation == "cudnn":
      _warn_once(why)
      implementation = "einsum"
  if implementation == "einsum":
    return einsum_attention(q, k, v, mask_BxTxS, precision, dtype)
  # jax's XLA path leaves float32 dots at precision=None; the context gives them the model's precision
  # (HIGHEST keeps float32 log-probs exact on GPUs, where the default is TF32).
  with jax.default_matmul_precision(_PRECISION_NAMES[precision]):
    how = dict(is_causal=True) if is_causal else dict(mask=mask_BxTxS[:, None, :, :])
    if impl == "cudnn":
      try:
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **how).astype(dtype)
      except (NotImplementedError, ValueError, RuntimeError) as e:  # raised while tracing: fall back
        if implementation == "cudnn":
          _warn_once(f"{type(e).__name__}: {e}")
          return einsum_attention(q, k, v, mask_BxTxS, precision, dtype)
    return jax.nn.dot_product_attention(q, k, v, implementation=None, **how).astype(dtype)


_PRECISION_NAMES = {jax.lax.Precision.HIGHEST: "highest", jax.lax.Precision.HIGH: "high",
                    jax.lax.Precision.DEFAULT: "default"}
