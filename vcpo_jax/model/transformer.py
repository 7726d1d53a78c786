"""Qwen2-architecture decoder transformer in Flax linen: logical axis names, log-probs and a KV cache."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vcpo_jax.model import attention as attention_lib
from vcpo_jax.model import lm_head
from vcpo_jax.model import lm_head_plain
from vcpo_jax.model.config import REMAT_POLICIES, ModelConfig

# Shape letters: B batch, T query length, S cache (key) length, D hidden, H query heads, K kv heads,
# E head dim, F MLP hidden, V vocab.

# ModelConfig and its tables live in model_config.py; imported here so model.ModelConfig keeps working.


def _init(scale: float = 0.02):
  return nn.initializers.normal(stddev=scale)


# `capture` of the modules below: False; True = book-keeping (sow each parametrised op's input, perturb its
# output: learner.grad_norms); or a learner.norm_taps.Taps, whose ops take a zero per-sequence "tap" per
# parameter (collection "norm_taps", laid out like "params") and return squared norms as its cotangent.
def _taps(capture):
  return None if isinstance(capture, bool) else capture


def _tap(module: nn.Module, name: str, x_BxTx_):
  return module.variable("norm_taps", name, jnp.zeros, x_BxTx_.shape[:1], jnp.float32).value


class Dense(nn.Module):
  """y = x @ kernel (+ bias). With `capture`, sows its input and perturbs its output (per-sequence grad norms)."""
  features: int
  kernel_axes: tuple[str, str]
  use_bias: bool
  cfg: ModelConfig
  capture: bool = False

  @nn.compact
  def __call__(self, x_BxTxI):
    kernel = self.param("kernel", nn.with_logical_partitioning(_init(), self.kernel_axes),
                        (x_BxTxI.shape[-1], self.features), self.cfg.jnp_param_dtype)
    dtype, taps = self.cfg.jnp_dtype, _taps(self.capture)
    if self.capture is True:
      self.sow("intermediates", "inputs", x_BxTxI)
    if taps:
      y_BxTxO = taps.dense(x_BxTxI.astype(dtype), kernel.astype(dtype), _tap(self, "kernel", x_BxTxI),
                           self.cfg.precision).astype(dtype)
    else:
      y_BxTxO = jnp.einsum("bti,io->bto", x_BxTxI.astype(dtype), kernel.astype(dtype),
                           preferred_element_type=jnp.float32, precision=self.cfg.precision).astype(dtype)
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.kernel_axes[1:]),
                        (self.features,), self.cfg.jnp_param_dtype)
      y_BxTxO = y_BxTxO + bias.astype(dtype)[None, None, :]
      if taps:
        y_BxTxO = taps.bias(y_BxTxO, _tap(self, "bias", x_BxTxI))
    if self.capture is True:
      y_BxTxO = self.perturb("outputs", y_BxTxO)
    return y_BxTxO


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
    if _taps(self.capture):
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

  @nn.compact
  def __call__(self, x_BxTxD, cos_BxTxE, sin_BxTxE, mask_BxTxS, kv_cache=None, cache_index=None, layer=None):
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dense = lambda n, axes, bias, name: Dense(n, axes, bias, cfg, self.capture, name=name)
    q = dense(H * E, ("embed", "q_heads"), True, "q_proj")(x_BxTxD).reshape(B, T, H, E)
    k = dense(K * E, ("embed", "kv_heads"), True, "k_proj")(x_BxTxD).reshape(B, T, K, E)
    v = dense(K * E, ("embed", "kv_heads"), True, "v_proj")(x_BxTxD).reshape(B, T, K, E)
    q = apply_rope(q, cos_BxTxE, sin_BxTxE)
    k = apply_rope(k, cos_BxTxE, sin_BxTxE)
    new_cache = None
    if kv_cache is not None:
      new_cache = tuple(write_cache(c, new, cache_index, layer) for c, new in zip(kv_cache, (k, v)))
      k, v = new_cache if layer is None else (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)
                                              for c in new_cache)
    out = attention_lib.attend(q, k, v, mask_BxTxS, implementation=cfg.attention, precision=cfg.precision,
                               dtype=cfg.jnp_dtype)
    out_BxTxD = dense(cfg.hidden_size, ("q_heads", "embed"), False, "o_proj")(out.reshape(B, T, H * E))
    return out_BxTxD, new_cache


class MLP(nn.Module):
  cfg: ModelConfig
  capture: bool = False

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.cfg
    gate = Dense(cfg.intermediate_size, ("embed", "mlp"), False, cfg, self.capture, name="gate_proj")(x_BxTxD)
    up = Dense(cfg.intermediate_size, ("embed", "mlp"), False, cfg, self.capture, name="up_proj")(x_BxTxD)
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(cfg.jnp_dtype)
    return Dense(cfg.hidden_size, ("mlp", "embed"), False, cfg, self.capture, name="down_proj")(h)


class Block(nn.Module):
  """One decoder layer as a scan step: carry (x, kv cache or None) -> (carry, None).

  `layer` is None when unrolled (kv cache = this layer's (k, v)); under scan it is the layer's index and the
  kv cache is the stacked one.
  """
  cfg: ModelConfig
  capture: bool = False

  @nn.compact
  def __call__(self, carry, layer, cos, sin, mask, cache_index):
    x, kv_cache = carry
    h, kv_cache = Attention(self.cfg, self.capture, name="self_attn")(
        RMSNorm(self.cfg, self.capture, name="input_layernorm")(x), cos, sin, mask, kv_cache, cache_index,
        layer)
    x = x + h
    x = x + MLP(self.cfg, self.capture, name="mlp")(
        RMSNorm(self.cfg, self.capture, name="post_attention_layernorm")(x))
    return (nn.with_logical_constraint(x, ("batch", "length", "act_embed")), kv_cache), None


def _layer_stack(cfg: ModelConfig, capture: bool):
  """The module running all layers: Block unrolled (one per layer), or one Block under nn.scan."""
  block = Block
  if REMAT_POLICIES[cfg.remat] is not None:
    # Under scan the loop already stops XLA from merging the recomputation with the forward (prevent_cse off).
    block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
  if not cfg.scan_layers:
    return block
  # Params and the capture collections (sown inputs, perturbations) are stacked on axis 0, the layers axis.
  return nn.scan(block, variable_axes={"params": 0, "intermediates": 0, "perturbations": 0,
                                                "norm_taps": 0},
                 split_rngs={"params": True}, in_axes=(0,) + (nn.broadcast,) * 4, length=cfg.num_layers,
                 metadata_params={nn.PARTITION_NAME: "layers"})


class HeadKernel(nn.Module):
  """The untied LM-head kernel [D, V] (applied by vcpo_jax.model.lm_head, which may chunk it)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self):
    return self.param("kernel", nn.with_logical_partitioning(_init(), ("embed", "vocab")),
                      (self.cfg.hidden_size, self.cfg.vocab_size), self.cfg.jnp_param_dtype)


class Transformer(nn.Module):
  """Decoder-only LM. Params: embed_tokens, layers_{i} (or `layers`, stacked, under scan), norm, lm_head
  (absent when tied).

  head=False returns the final normed hidden states [B, T, D] instead of float32 logits (the LM head is
  then applied by vcpo_jax.model.lm_head, in chunks, without [tokens, vocab] logits).
  """
  cfg: ModelConfig
  capture: bool = False
  head: bool = True

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None):
    cfg = self.cfg
    embedding = self.param("embed_tokens", nn.with_logical_partitioning(_init(), ("vocab", "embed")),
                           (cfg.vocab_size, cfg.hidden_size), cfg.jnp_param_dtype)
    x = jnp.take(embedding, tokens_BxT, axis=0).astype(cfg.jnp_dtype)
    if self.capture:
      x = self.perturb("embed_outputs", x)
    x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
    cos, sin = rope_cos_sin(positions_BxT, cfg.head_dim, cfg.rope_theta)
    stack = _layer_stack(cfg, self.capture)
    if cfg.scan_layers:
      layers_L = jnp.arange(cfg.num_layers, dtype=jnp.int32)
      (x, new_cache), _ = stack(cfg, self.capture, name="layers")((x, cache), layers_L, cos, sin, mask_BxTxS,
                                                                  cache_index)
    else:
      new_cache = []
      for i in range(cfg.num_layers):
        (x, layer_cache), _ = stack(cfg, self.capture, name=f"layers_{i}")(
            (x, None if cache is None else cache[i]), None, cos, sin, mask_BxTxS, cache_index)
        new_cache.append(layer_cache)
      new_cache = None if cache is None else tuple(new_cache)
    x = RMSNorm(cfg, self.capture, name="norm")(x)
    if not self.head:
      return x, new_cache
    w_DxV = embedding.T if cfg.tie_word_embeddings else HeadKernel(cfg, name="lm_head")()
    return lm_head_plain.logits(x, w_DxV, cfg.precision), new_cache


def causal_mask(positions_BxT, key_mask_BxT=None):
  """Query t sees key s when s <= t (by index) and the key is valid."""
  T = positions_BxT.shape[1]
  mask_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
  mask_BxTxT = jnp.broadcast_to(mask_TxT[None], (positions_BxT.shape[0], T, T))
  if key_mask_BxT is not None:
    mask_BxTxT = mask_BxTxT & key_mask_BxT[:, None, :].astype(bool)
  return mask_BxTxT


def _default_positions(tokens_BxT):
  return jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32)[None], tokens_BxT.shape)


def init_params(cfg: ModelConfig, rng, *, boxed: bool = False):
  """Random init. `boxed=True` keeps nn.Partitioned boxes (logical axis names) for sharded creation."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  positions = _default_positions(tokens)
  variables = Transformer(cfg).init(rng, tokens, positions, causal_mask(positions))
  params = variables["params"]
  return params if boxed else nn.unbox(params)


def forward(params, cfg: ModelConfig, tokens_BxT, positions_BxT=None, key_mask_BxT=None):
  """Full forward to float32 logits."""
  if positions_BxT is None:
    positions_BxT = _default_positions(tokens_BxT)
  logits, _ = Transformer(cfg).apply({"params": params}, tokens_BxT, positions_BxT,
                                     causal_mask(positions_BxT, key_mask_BxT))
  return logits


def hidden_states(params, cfg: ModelConfig, tokens_BxT, positions_BxT=None, key_mask_BxT=None):
  """Final normed hidden states [B, T, D] in the compute dtype (the LM head's input)."""
  if positions_BxT is None:
    positions_BxT = _default_positions(tokens_BxT)
  x, _ = Transformer(cfg, head=False).apply({"params": params}, tokens_BxT, positions_BxT,
                                            causal_mask(positions_BxT, key_mask_BxT))
  return x


def head_kernel(params, cfg: ModelConfig):
  """The LM-head kernel w_DxV: lm_head/kernel, or embed_tokens transposed when tied."""
  return params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]["kernel"]


def token_logprobs_and_entropy(params, cfg: ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None,
                               key_mask_BxT=None):
  x_BxTxD = hidden_states(params, cfg, tokens_BxT, positions_BxT, key_mask_BxT)
  return lm_head.token_logprobs_and_entropy(x_BxTxD, head_kernel(params, cfg), tokens_BxT, mask_BxT,
                                            cfg.precision, cfg.logits_chunk)


def token_logprobs(params, cfg: ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None, key_mask_BxT=None):
  return token_logprobs_and_entropy(params, cfg, tokens_BxT, mask_BxT, positions_BxT, key_mask_BxT)[0]


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


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int):
  """An opaque pytree: per-layer (k, v) buffers [B, S, K, E] in the compute dtype, or under scan one stacked
  (k, v) pair [L, B, S, K, E]."""
  shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
  if cfg.scan_layers:
    shape = (cfg.num_layers,) + shape
    return (jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype))
  return tuple((jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype))
               for _ in range(cfg.num_layers))


def decode(params, cfg: ModelConfig, tokens_BxT, positions_BxT, cache, cache_index, key_mask_BxS, *,
           head: bool = True):
  """Incremental step: writes k/v of T new tokens at [cache_index, cache_index+T); returns logits and cache.

  cache_index is a scalar (all rows at one slot) or int32 [B] (each row at its own slot: continuous batching).
  head=False returns the final hidden states instead of logits (prefill: see prompt_logprobs_and_logits).
  """
  B, T = tokens_BxT.shape
  S = key_mask_BxS.shape[1]
  slot_S = jnp.arange(S, dtype=jnp.int32)
  index_B = jnp.broadcast_to(jnp.asarray(cache_index, jnp.int32), (B,))
  query_slot_BxT = index_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  mask_BxTxS = (slot_S[None, None, :] <= query_slot_BxT[:, :, None]) & key_mask_BxS[:, None, :].astype(bool)
  out, new_cache = Transformer(cfg, head=head).apply({"params": params}, tokens_BxT, positions_BxT, mask_BxTxS,
                                                     cache, cache_index)
  return out, new_cache


def prompt_logprobs_and_logits(params, cfg: ModelConfig, x_BxPxD, tokens_BxP, last_B):
  """Prefill's outputs from hidden states, without [B, P, V] logits: the prompt tokens' log-probs [B, P]
  (chunked LM head; position 0 gets 0) and float32 logits [B, V] at each row's position last_B."""
  w_DxV = head_kernel(params, cfg)
  logp_BxP = lm_head.token_logprobs_and_entropy(x_BxPxD, w_DxV, tokens_BxP, jnp.ones_like(tokens_BxP),
                                                cfg.precision, cfg.logits_chunk)[0]
  x_Bx1xD = jnp.take_along_axis(x_BxPxD, jnp.asarray(last_B, jnp.int32)[:, None, None], axis=1)
  return logp_BxP, lm_head_plain.logits(x_Bx1xD, w_DxV, cfg.precision)[:, 0]


def param_logical_axes(cfg: ModelConfig):
  """Logical axis names of every parameter, as a pytree of PartitionSpec-like tuples."""
  boxed = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), boxed=True))
  return nn.get_partition_spec(boxed)


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def stack_layers(params, num_layers: int):
  """Unrolled params (layers_0 .. layers_{L-1}) -> the scan layout (one `layers` subtree, leaves [L, ...])."""
  out = {k: v for k, v in params.items() if not k.startswith("layers_")}
  out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"] for i in range(num_layers)])
  return out


def unstack_layers(params, num_layers: int):
  """The scan layout -> layers_0 .. layers_{L-1} (e.g. to load into scan_layers=False)."""
  out = {k: v for k, v in params.items() if k != "layers"}
  for i in range(num_layers):
    out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
  return out
