"""Qwen2-architecture decoder transformer in Flax linen: logical axis names, log-probs and a KV cache."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vcpo_jax.model import layers
from vcpo_jax.model import lm_head
from vcpo_jax.model import lm_head_plain
from vcpo_jax.model.config import REMAT_POLICIES, ModelConfig

# Shape letters: B batch, T query length, S cache (key) length, D hidden, H query heads, K kv heads,
# E head dim, F MLP hidden, V vocab.


class Block(nn.Module):
  """One decoder layer as a scan step: carry (x, kv cache or None) -> (carry, None).

  `layer` is None when unrolled (kv cache = this layer's (k, v)); under scan it is the layer's index and the
  kv cache is the stacked one.
  """
  cfg: ModelConfig
  capture: bool = False
  causal: bool = False  # the mask is exactly causal: attention may take is_causal instead (model.causal_flag)

  @nn.compact
  def __call__(self, carry, layer, cos, sin, mask, cache_index, adapter_B=None):
    x, kv_cache = carry
    h, kv_cache = layers.Attention(self.cfg, self.capture, self.causal, name="self_attn")(
        layers.RMSNorm(self.cfg, self.capture, name="input_layernorm")(x), cos, sin, mask, kv_cache, cache_index,
        layer, adapter_B)
    x = x + h
    x = x + layers.MLP(self.cfg, self.capture, name="mlp")(
        layers.RMSNorm(self.cfg, self.capture, name="post_attention_layernorm")(x), adapter_B)
    return (nn.with_logical_constraint(x, ("batch", "length", "act_embed")), kv_cache), None


def _layer_stack(cfg: ModelConfig, capture: bool):
  """The module running all layers: Block unrolled (one per layer), or one Block under nn.scan."""
  block = Block
  if REMAT_POLICIES.get(cfg.remat) is not None:  # "auto" unresolved: a forward alone, nothing to keep
    # Under scan the loop already stops XLA from merging the recomputation with the forward (prevent_cse off).
    block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
  if not cfg.scan_layers:
    return block
  # Params, adapters ("lora", vcpo_jax.model.lora) and the capture collections (sown inputs, perturbations)
  # are stacked on axis 0, the layers axis.
  return nn.scan(block, variable_axes={"params": 0, "lora": 0, "intermediates": 0, "perturbations": 0,
                                                "norm_taps": 0},
                 split_rngs={"params": True}, in_axes=(0,) + (nn.broadcast,) * 5, length=cfg.num_layers,
                 metadata_params={nn.PARTITION_NAME: "layers"})


class HeadKernel(nn.Module):
  """The untied LM-head kernel [D, V] (applied by vcpo_jax.model.lm_head, which may chunk it)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self):
    return self.param("kernel", nn.with_logical_partitioning(layers.init_normal(), ("embed", "vocab")),
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
  def __call__(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None, adapter_B=None):
    """mask_BxTxS None: exactly causal by index, every key valid (see `attention_mask`). The "lora"
    collection, when given, holds one adapter (adapter_B None) or a stack whose slot row b uses (adapter_B
    int32 [B], -1 = none): vcpo_jax.model.lora."""
    cfg = self.cfg
    causal = mask_BxTxS is None
    if causal:
      if cache is not None:
        raise ValueError("Transformer: mask_BxTxS=None (causal) is for a full forward, not a KV-cache decode")
      mask_BxTxS = causal_mask(positions_BxT)
    causal = causal and cfg.causal_flag
    embedding = self.param("embed_tokens", nn.with_logical_partitioning(layers.init_normal(), ("vocab", "embed")),
                           (cfg.vocab_size, cfg.hidden_size), cfg.jnp_param_dtype)
    x = jnp.take(embedding, tokens_BxT, axis=0).astype(cfg.jnp_dtype)
    if self.capture:
      x = self.perturb("embed_outputs", x)
    x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
    cos, sin = layers.rope_cos_sin(positions_BxT, cfg.head_dim, cfg.rope_theta)
    stack = _layer_stack(cfg, self.capture)
    if cfg.scan_layers:
      layers_L = jnp.arange(cfg.num_layers, dtype=jnp.int32)
      (x, new_cache), _ = stack(cfg, self.capture, causal, name="layers")((x, cache), layers_L, cos, sin,
                                                                          mask_BxTxS, cache_index, adapter_B)
    else:
      new_cache = []
      for i in range(cfg.num_layers):
        (x, layer_cache), _ = stack(cfg, self.capture, causal, name=f"layers_{i}")(
            (x, None if cache is None else cache[i]), None, cos, sin, mask_BxTxS, cache_index, adapter_B)
        new_cache.append(layer_cache)
      new_cache = None if cache is None else tuple(new_cache)
    x = layers.RMSNorm(cfg.head_config, self.capture, name="norm")(x)  # model.head_dtype from here on
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


def attention_mask(positions_BxT, key_mask_BxT=None):
  """The Transformer's mask argument for a full forward: None (exactly causal, so attention may use a causal
  kernel) without a key mask, as in the learner's right-padded rows; else causal_mask's boolean mask."""
  return None if key_mask_BxT is None else causal_mask(positions_BxT, key_mask_BxT)


def _default_positions(tokens_BxT):
  return jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32)[None], tokens_BxT.shape)


def init_params(cfg: ModelConfig, rng, *, boxed: bool = False):
  """Random init. `boxed=True` keeps nn.Partitioned boxes (logical axis names) for sharded creation."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  positions = _default_positions(tokens)
  variables = Transformer(cfg).init(rng, tokens, positions, causal_mask(positions))
  params = variables["params"]
  return params if boxed else nn.unbox(params)


def variables(params, adapter=None) -> dict:
  """The model's variables: params, plus the "lora" collection when an adapter (or a stack) is given."""
  return {"params": params} if adapter is None else {"params": params, "lora": adapter}


def forward(params, cfg: ModelConfig, tokens_BxT, positions_BxT=None, key_mask_BxT=None, *, adapter=None,
            adapter_B=None):
  """Full forward to float32 logits. adapter: None, one adapter, or a stack with adapter_B (model.lora)."""
  if positions_BxT is None:
    positions_BxT = _default_positions(tokens_BxT)
  logits, _ = Transformer(cfg).apply(variables(params, adapter), tokens_BxT, positions_BxT,
                                     attention_mask(positions_BxT, key_mask_BxT), adapter_B=adapter_B)
  return logits


def hidden_states(params, cfg: ModelConfig, tokens_BxT, positions_BxT=None, key_mask_BxT=None, *, adapter=None,
                  adapter_B=None):
  """Final normed hidden states [B, T, D] in the compute dtype (the LM head's input)."""
  if positions_BxT is None:
    positions_BxT = _default_positions(tokens_BxT)
  x, _ = Transformer(cfg, head=False).apply(variables(params, adapter), tokens_BxT, positions_BxT,
                                            attention_mask(positions_BxT, key_mask_BxT), adapter_B=adapter_B)
  return x


def head_kernel(params, cfg: ModelConfig):
  """The LM-head kernel w_DxV: lm_head/kernel, or embed_tokens transposed when tied."""
  return params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]["kernel"]


def token_logprobs_and_entropy(params, cfg: ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None,
                               key_mask_BxT=None, *, adapter=None, adapter_B=None):
  x_BxTxD = hidden_states(params, cfg, tokens_BxT, positions_BxT, key_mask_BxT, adapter=adapter,
                          adapter_B=adapter_B)
  return lm_head.token_logprobs_and_entropy(x_BxTxD, head_kernel(params, cfg), tokens_BxT, mask_BxT,
                                            **cfg.head_logprob_args())


def token_logprobs(params, cfg: ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None, key_mask_BxT=None, *,
                   adapter=None, adapter_B=None):
  return token_logprobs_and_entropy(params, cfg, tokens_BxT, mask_BxT, positions_BxT, key_mask_BxT,
                                    adapter=adapter, adapter_B=adapter_B)[0]


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
           head: bool = True, adapter=None, adapter_B=None):
  """Incremental step: writes k/v of T new tokens at [cache_index, cache_index+T); returns logits and cache.

  cache_index is a scalar (all rows at one slot) or int32 [B] (each row at its own slot: continuous batching).
  head=False returns the final hidden states instead of logits (prefill: see prompt_logprobs_and_logits).
  adapter: None, one adapter for every row, or a stack of adapters with adapter_B (int32 [B], -1 = none) naming
  each row's slot (vcpo_jax.model.lora).
  """
  B, T = tokens_BxT.shape
  S = key_mask_BxS.shape[1]
  slot_S = jnp.arange(S, dtype=jnp.int32)
  index_B = jnp.broadcast_to(jnp.asarray(cache_index, jnp.int32), (B,))
  query_slot_BxT = index_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  mask_BxTxS = (slot_S[None, None, :] <= query_slot_BxT[:, :, None]) & key_mask_BxS[:, None, :].astype(bool)
  out, new_cache = Transformer(cfg, head=head).apply(variables(params, adapter), tokens_BxT, positions_BxT,
                                                     mask_BxTxS, cache, cache_index, adapter_B)
  return out, new_cache


def prompt_logprobs_and_logits(params, cfg: ModelConfig, x_BxPxD, tokens_BxP, last_B):
  """Prefill's outputs from hidden states, without [B, P, V] logits: the prompt tokens' log-probs [B, P]
  (chunked LM head; position 0 gets 0) and float32 logits [B, V] at each row's position last_B."""
  w_DxV = head_kernel(params, cfg)
  logp_BxP = lm_head.token_logprobs_and_entropy(x_BxPxD, w_DxV, tokens_BxP, jnp.ones_like(tokens_BxP),
                                                **cfg.head_logprob_args())[0]
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
