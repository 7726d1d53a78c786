"""The transformer's parametrised building blocks: Dense, RMSNorm, rotary embeddings, GQA attention, MLP."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vcpo_jax.model import attention as attention_lib
from vcpo_jax.model.config import ModelConfig

# Shape letters: B batch, T query length, S cache (key) length, D hidden, H query heads, K kv heads,
# E head dim, F MLP hidden, V vocab.


def init_normal(scale: float = 0.02):
  return nn.initializers.normal(stddev=scale)


# `capture` of the modules below: False; True = book-keeping (sow each parametrised op's input, perturb its
# output: learner.grad_norms); or a learner.norm_taps.Taps, whose ops take a zero per-sequence "tap" per
# parameter (collection "norm_taps", laid out like "params") and return squared norms as its cotangent.
def _taps(capture):
  return None if isinstance(capture, bool) else capture


def _tap(module: nn.Module, name: str, x_BxTx_):
  return module.variable("norm_taps", name, jnp.zeros, x_BxTx_.shape[:1], jnp.float32).value


class Dense(nn.Module):
  """y = x @ kernel (+ bias), + (alpha / r) (x A) B when the "lora" collection holds this layer's adapter.

  With `capture`, sows its input and perturbs its output (per-sequence grad norms); with an adapter also the
  adapter's inner activations (A's output is perturbed, B's input sown), and with Taps only the adapter's ops
  take taps when taps.adapter_only (the frozen base has no gradient)."""
  features: int
  kernel_axes: tuple[str, str]
  use_bias: bool
  cfg: ModelConfig
  capture: bool = False

  @nn.compact
  def __call__(self, x_BxTxI, adapter_B=None):
    kernel = self.param("kernel", nn.with_logical_partitioning(init_normal(), self.kernel_axes),
                        (x_BxTxI.shape[-1], self.features), self.cfg.jnp_param_dtype)
    dtype, taps = self.cfg.jnp_dtype, _taps(self.capture)
    lora = self.has_variable("lora", "lora_A")
    if self.capture is True:
      self.sow("intermediates", "inputs", x_BxTxI)
    if taps and not taps.adapter_only:
      y_BxTxO = taps.dense(x_BxTxI.astype(dtype), kernel.astype(dtype), _tap(self, "kernel", x_BxTxI),
                           self.cfg.precision)
    else:
      y_BxTxO = jnp.einsum("bti,io->bto", x_BxTxI.astype(dtype), kernel.astype(dtype),
                           preferred_element_type=jnp.float32, precision=self.cfg.precision)
    if lora:  # added in float32 before the one cast to the compute dtype
      y_BxTxO = y_BxTxO + self._lora(x_BxTxI.astype(dtype), adapter_B, taps)
    y_BxTxO = y_BxTxO.astype(dtype)
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.kernel_axes[1:]),
                        (self.features,), self.cfg.jnp_param_dtype)
      y_BxTxO = y_BxTxO + bias.astype(dtype)[None, None, :]
      if taps and not taps.adapter_only:
        y_BxTxO = taps.bias(y_BxTxO, _tap(self, "bias", x_BxTxI))
    if self.capture is True:
      y_BxTxO = self.perturb("outputs", y_BxTxO)
    return y_BxTxO

  def _lora(self, x_BxTxI, adapter_B, taps):
    """(alpha / r) (x A) B in float32 (compute-dtype operands, float32 accumulation). adapter_B None: one
    adapter [I, R], [R, O] for every row; else a stack [N, I, R], [N, R, O] and row b uses slot adapter_B[b]
    (-1: none)."""
    dtype, precision = self.cfg.jnp_dtype, self.cfg.precision
    a, b = (self.get_variable("lora", k).astype(dtype) for k in ("lora_A", "lora_B"))
    if a.shape[-1] != self.cfg.lora.rank:  # the scale alpha / rank is the config's: a mismatch would be silent
      raise ValueError(f"{self.name}: an adapter of rank {a.shape[-1]} with model.lora.rank="
                       f"{self.cfg.lora.rank} (lora.fit puts adapters of other ranks into this shape)")
    dot = dict(preferred_element_type=jnp.float32, precision=precision)
    if adapter_B is None:
      if taps:
        u_BxTxR = taps.dense(x_BxTxI, a, _tap(self, "lora_A", x_BxTxI), precision)
      else:
        u_BxTxR = jnp.einsum("bti,ir->btr", x_BxTxI, a, **dot)
    else:
      slot_B = jnp.asarray(adapter_B, jnp.int32)
      u_BxTxR = jnp.einsum("bti,bir->btr", x_BxTxI, jnp.take(a, jnp.maximum(slot_B, 0), axis=0), **dot)
      u_BxTxR = jnp.where((slot_B >= 0)[:, None, None], u_BxTxR, 0.0)
    u_BxTxR = u_BxTxR.astype(dtype)
    if self.capture is True:
      u_BxTxR = self.perturb("lora_A_outputs", u_BxTxR)
    u_BxTxR = (u_BxTxR.astype(jnp.float32) * self.cfg.lora.scale).astype(dtype)
    if self.capture is True:
      self.sow("intermediates", "lora_B_inputs", u_BxTxR)
    if adapter_B is not None:
      b_BxRxO = jnp.take(b, jnp.maximum(jnp.asarray(adapter_B, jnp.int32), 0), axis=0)
      return jnp.einsum("btr,bro->bto", u_BxTxR, b_BxRxO, **dot)
    if taps:
      return taps.dense(u_BxTxR, b, _tap(self, "lora_B", x_BxTxI), precision)
    return jnp.einsum("btr,ro->bto", u_BxTxR, b, **dot)


class RMSNorm(nn.Module):
  """RMSNorm computed in float32, as Qwen2 does; `capture` exposes the normalised input and output-grad."""
  cfg: ModelConfig
  capture: bool = False

  @nn.compact
  def __call__(self, x_BxTxD):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x_BxTxD.shape[-1],), self.cfg.jnp_param_dtype)
    x = x_BxTxD.astype(jnp.float32)
    xhat = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
    xhat = xhat.astype(self.cfg.jnp_dtype)
    if self.capture is True:
      self.sow("intermediates", "inputs", xhat)
    if _taps(self.capture) and not _taps(self.capture).adapter_only:
      return _taps(self.capture).scale(xhat, scale.astype(self.cfg.jnp_dtype), _tap(self, "scale", xhat))
    y = xhat * scale.astype(self.cfg.jnp_dtype)[None, None, :]
    if self.capture is True:
      y = self.perturb("outputs", y)
    return y


def rope_cos_sin(positions_BxT, head_dim: int, theta: float):
  """Qwen2/Llama RoPE tables (non-interleaved halves), float32."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs_BxTxE2 = positions_BxT.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  emb_BxTxE = jnp.concatenate([freqs_BxTxE2, freqs_BxTxE2], axis=-1)
  return jnp.cos(emb_BxTxE), jnp.sin(emb_BxTxE)


def apply_rope(x_BxTxNxE, cos_BxTxE, sin_BxTxE):
  half = x_BxTxNxE.shape[-1] // 2
  x1, x2 = x_BxTxNxE[..., :half], x_BxTxNxE[..., half:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  x = x_BxTxNxE.astype(jnp.float32)
  out = x * cos_BxTxE[:, :, None, :] + rotated.astype(jnp.float32) * sin_BxTxE[:, :, None, :]
  return out.astype(x_BxTxNxE.dtype)


class Attention(nn.Module):
  """Grouped-query attention with q/k/v bias and an optional KV cache (functional: passed in and returned).

  With `layer` (under scan) kv_cache is the whole stacked cache [L, B, S, K, E]: the new entries are written
  in place at that layer and only its slice is read.
  """
  cfg: ModelConfig
  capture: bool = False
  causal: bool = False  # mask_BxTxS is exactly causal by index: attend may use is_causal instead

  @nn.compact
  def __call__(self, x_BxTxD, cos_BxTxE, sin_BxTxE, mask_BxTxS, kv_cache=None, cache_index=None, layer=None,
               adapter_B=None):
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dense = lambda n, axes, bias, name: Dense(n, axes, bias, cfg, self.capture, name=name)
    q = dense(H * E, ("embed", "q_heads"), True, "q_proj")(x_BxTxD, adapter_B).reshape(B, T, H, E)
    k = dense(K * E, ("embed", "kv_heads"), True, "k_proj")(x_BxTxD, adapter_B).reshape(B, T, K, E)
    v = dense(K * E, ("embed", "kv_heads"), True, "v_proj")(x_BxTxD, adapter_B).reshape(B, T, K, E)
    q = apply_rope(q, cos_BxTxE, sin_BxTxE)
    k = apply_rope(k, cos_BxTxE, sin_BxTxE)
    new_cache = None
    if kv_cache is not None:
      new_cache = tuple(write_cache(c, new, cache_index, layer) for c, new in zip(kv_cache, (k, v)))
      k, v = new_cache if layer is None else (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)
                                              for c in new_cache)
    out = attention_lib.attend(q, k, v, mask_BxTxS, implementation=cfg.attention, precision=cfg.precision,
                               dtype=cfg.jnp_dtype, is_causal=self.causal and kv_cache is None)
    out_BxTxD = dense(cfg.hidden_size, ("q_heads", "embed"), False, "o_proj")(out.reshape(B, T, H * E),
                                                                             adapter_B)
    return out_BxTxD, new_cache


class MLP(nn.Module):
  cfg: ModelConfig
  capture: bool = False

  @nn.compact
  def __call__(self, x_BxTxD, adapter_B=None):
    cfg = self.cfg
    dense = lambda n, axes, name: Dense(n, axes, False, cfg, self.capture, name=name)
    gate = dense(cfg.intermediate_size, ("embed", "mlp"), "gate_proj")(x_BxTxD, adapter_B)
    up = dense(cfg.intermediate_size, ("embed", "mlp"), "up_proj")(x_BxTxD, adapter_B)
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(cfg.jnp_dtype)
    return dense(cfg.hidden_size, ("mlp", "embed"), "down_proj")(h, adapter_B)


def write_cache(cache_BxSxKxE, new_BxTxKxE, cache_index, layer=None):
  """Writes T new entries at slot cache_index (scalar, or int32 [B]: one slot per row).

  With `layer` the cache is stacked [L, B, S, K, E] and only that layer's T entries are written.
  """
  new_BxTxKxE = new_BxTxKxE.astype(cache_BxSxKxE.dtype)
  index = jnp.asarray(cache_index, jnp.int32)
  if layer is not None:
    if index.ndim == 0:
      return jax.lax.dynamic_update_slice(cache_BxSxKxE, new_BxTxKxE[None], (layer, 0, index, 0, 0))
    return jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u[None], (layer, i, 0, 0)),
                    in_axes=(1, 0, 0), out_axes=1)(cache_BxSxKxE, new_BxTxKxE, index)
  if index.ndim == 0:
    return jax.lax.dynamic_update_slice(cache_BxSxKxE, new_BxTxKxE, (0, index, 0, 0))
  return jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i, 0, 0)))(
      cache_BxSxKxE, new_BxTxKxE, index)
