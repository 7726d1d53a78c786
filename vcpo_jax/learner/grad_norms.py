"""Per-sequence squared gradient norms and the per-sequence-weighted gradient from one forward + one backward."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import traverse_util

from vcpo_jax.learner import op_norms
from vcpo_jax.model import config as model_config
from vcpo_jax.model import lm_head
from vcpo_jax.model import transformer as M

# Shape letters: B batch, T/S length (query/key index of a Gram), I/O dense in/out, D hidden, V vocab.
# s_i = grad_theta sum_t m_t log pi(y_t) is the score of sequence i. For every parametrised op we hold its
# inputs a (sown) and the output-gradients g of sum_i sum_t m log pi (gradient wrt a zero perturbation);
# rows do not interact, so row i of g is sequence i's own output-gradient.
# Memory: a and g of every layer are held for the rows given at once; callers bound it by passing
# micro-batches (learner.LearnerConfig.micro_batch_size scans over chunks of whole prompt groups).

MODES = op_norms.MODES  # every entry point here takes one of these
CoefFn = Callable[..., tuple[jax.Array, Any]]
HEAD = ("lm_head_inputs",)  # capture() key of (x_BxTxD, w_DxV, mask_BxT) for the LM head terms
_F32 = jnp.float32


# ---------------------------------------------------------------------------------------------------------
# Capture: one forward (sowing inputs) and one backward with unit per-sequence cotangents.
# ---------------------------------------------------------------------------------------------------------

def _zero_perturbations(cfg: model_config.ModelConfig, tokens_BxT, positions_BxT, params=None, adapter=None):
  if adapter is None:
    shapes = jax.eval_shape(lambda: M.Transformer(cfg, capture=True).init(
        jax.random.PRNGKey(0), tokens_BxT, positions_BxT, None))["perturbations"]
  else:  # the adapters' own perturbations exist only where the "lora" collection is given
    shapes = jax.eval_shape(lambda: M.Transformer(cfg, capture=True).apply(
        M.variables(params, adapter), tokens_BxT, positions_BxT, None,
        mutable=["perturbations", "intermediates"])[1]["perturbations"])
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def capture(params, cfg: model_config.ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None, key_mask_BxT=None,
            adapter=None):
  """Returns (logp_BxT, ent_BxT, inputs, out_grads): flat dicts keyed by module path tuples. With an adapter
  also its inner activations: module + ("lora_B_inputs",) and module + ("lora_A_outputs",)."""
  if positions_BxT is None:
    positions_BxT = M._default_positions(tokens_BxT)
  attn_mask = M.attention_mask(positions_BxT, key_mask_BxT)
  perts = _zero_perturbations(cfg, tokens_BxT, positions_BxT, params, adapter)

  def total_logp(perts):
    (x_BxTxD, _), state = M.Transformer(cfg, capture=True, head=False).apply(
        {**M.variables(params, adapter), "perturbations": perts}, tokens_BxT, positions_BxT, attn_mask,
        mutable=["intermediates"])
    logp_BxT, ent_BxT = lm_head.token_logprobs_and_entropy(x_BxTxD, M.head_kernel(params, cfg), tokens_BxT,
                                                           mask_BxT, **cfg.head_logprob_args())
    return jnp.sum(logp_BxT), (logp_BxT, ent_BxT, state["intermediates"], x_BxTxD)

  out_grads, (logp_BxT, ent_BxT, inputs, x_BxTxD) = jax.grad(total_logp, has_aux=True)(perts)
  inputs = {k[:-1] if k[-1] == "inputs" else k: v[0]  # sow keeps a tuple
            for k, v in traverse_util.flatten_dict(inputs).items()}
  # The LM head's per-sequence terms are computed by vcpo_jax.model.lm_head from its input and the mask; one
  # log-sum-exp pass over the vocabulary serves all of them.
  w_DxV = M.head_kernel(params, cfg)
  lse_BxT = lm_head.logsumexp(x_BxTxD, w_DxV, cfg.precision, cfg.head_chunk)
  inputs[HEAD] = (x_BxTxD, w_DxV, mask_BxT, lse_BxT)
  out_grads = {k[:-1] if k[-1] == "outputs" else k: v
               for k, v in traverse_util.flatten_dict(out_grads).items()}
  return logp_BxT, ent_BxT, inputs, out_grads


def _leaf_name(path) -> str:
  return "/".join(path)


def _stacked(path, cfg: model_config.ModelConfig) -> bool:
  return cfg.scan_layers and path[0] == "layers"


def _per_layer(path, cfg: model_config.ModelConfig, rule, a, g):
  """rule(a, g) of one layer; under scan a and g are stacked [L, ...] and the rule maps over the layers
  (one layer's temporaries at a time), giving results stacked on the same leading axis."""
  if _stacked(path, cfg):
    return jax.lax.map(lambda ag: rule(*ag), (a, g))
  return rule(a, g)


def _operands(path, inputs, out_grads):
  """(a, g) of a layer parameter: its op's input and output-gradient. An adapter's A maps the layer's input
  to its rank-R activation (perturbed as lora_A_outputs); B maps that activation, scaled (sown as
  lora_B_inputs), to the layer's output."""
  module, leaf = path[:-1], path[-1]
  if leaf == "lora_A":
    return inputs.get(module), out_grads.get(module + ("lora_A_outputs",))
  if leaf == "lora_B":
    return inputs.get(module + ("lora_B_inputs",)), out_grads.get(module)
  return inputs.get(module), out_grads.get(module)


def _layer_sq_rule(path, mode: str):
  leaf = path[-1]
  if leaf in ("kernel", "lora_A", "lora_B"):
    return lambda a, g: op_norms.dense_sq_norms(a, g, mode)
  if leaf == "bias":
    return lambda a, g: op_norms.bias_sq_norms(g)
  if leaf == "scale":
    return op_norms.scale_sq_norms
  raise ValueError(f"grad_norms: no per-sequence rule for parameter {_leaf_name(path)!r}")


def _layer_grad_rule(path, c_B):
  leaf = path[-1]
  if leaf in ("kernel", "lora_A", "lora_B"):
    return lambda a, g: op_norms.dense_weighted_grad(a, g, c_B)
  if leaf == "bias":
    return lambda a, g: op_norms.bias_weighted_grad(g, c_B)
  if leaf == "scale":
    return lambda a, g: op_norms.scale_weighted_grad(a, g, c_B)
  raise ValueError(f"grad_norms: no per-sequence rule for parameter {_leaf_name(path)!r}")


def _leaf_sq_norms(path, tokens_BxT, inputs, out_grads, cfg: model_config.ModelConfig, mode: str):
  """Per-sequence squared norm of one parameter leaf (for a tied embedding: embedding + head + cross)."""
  x, w, mask, lse = inputs[HEAD]
  head = dict(precision=cfg.precision, chunk=cfg.head_chunk, lse_BxT=lse)
  if path == ("embed_tokens",):
    g_emb = out_grads[("embed_outputs",)]
    sq_B = op_norms.embedding_sq_norms(tokens_BxT, g_emb, cfg.vocab_size, mode)
    if cfg.tie_word_embeddings:
      sq_B = sq_B + lm_head.head_sq_norms(x, w, tokens_BxT, mask, mode, **head)
      sq_B = jnp.maximum(
          sq_B + 2.0 * lm_head.tied_cross_terms(tokens_BxT, g_emb, x, w, mask, **head), 0.0)
    return sq_B
  if path == ("lm_head", "kernel"):
    return lm_head.head_sq_norms(x, w, tokens_BxT, mask, mode, **head)
  sq = _per_layer(path, cfg, _layer_sq_rule(path, mode), *_operands(path, inputs, out_grads))
  return jnp.sum(sq, axis=0) if _stacked(path, cfg) else sq  # under scan [L, B]: summed over the layers


def _leaf_weighted_grad(path, tokens_BxT, inputs, out_grads, c_B, cfg: model_config.ModelConfig):
  x, w, mask, lse = inputs[HEAD]
  head = dict(precision=cfg.precision, chunk=cfg.head_chunk, lse_BxT=lse)
  if path == ("embed_tokens",):
    grad = op_norms.embedding_weighted_grad(tokens_BxT, out_grads[("embed_outputs",)], c_B, cfg.vocab_size)
    if cfg.tie_word_embeddings:
      grad = grad + lm_head.head_weighted_grad(x, w, tokens_BxT, mask, c_B, **head).T
    return grad
  if path == ("lm_head", "kernel"):
    return lm_head.head_weighted_grad(x, w, tokens_BxT, mask, c_B, **head)
  return _per_layer(path, cfg, _layer_grad_rule(path, c_B), *_operands(path, inputs, out_grads))


def _norms_from_capture(params, cfg, tokens_BxT, inputs, out_grads, mode):
  leaf_sq = {_leaf_name(p): _leaf_sq_norms(p, tokens_BxT, inputs, out_grads, cfg, mode)
             for p in traverse_util.flatten_dict(params)}
  return sum(leaf_sq.values()), leaf_sq


def per_sequence_sq_norms(params, cfg: model_config.ModelConfig, tokens_BxT, mask_BxT, positions_BxT=None,
                          key_mask_BxT=None, *, mode: str = "auto", adapter=None):
  """(sq_norms_B, aux): ||grad_theta sum_t m_t log pi(y_t)||^2 over all parameters, per sequence; with an
  adapter (model.lora) theta is the adapter alone (params frozen).

  aux: logp_BxT, ent_BxT (both masked) and leaf_sq_norms {"a/b/kernel": sq_B} (sums to sq_norms_B).
  """
  op_norms.check_mode(mode)
  logp_BxT, ent_BxT, inputs, out_grads = capture(params, cfg, tokens_BxT, mask_BxT, positions_BxT,
                                                 key_mask_BxT, adapter)
  trainable = params if adapter is None else adapter
  sq_B, leaf_sq = _norms_from_capture(trainable, cfg, tokens_BxT, inputs, out_grads, mode)
  return sq_B, {"logp_BxT": logp_BxT, "ent_BxT": ent_BxT, "leaf_sq_norms": leaf_sq}


def per_sequence_sq_norms_and_grad(params, cfg: model_config.ModelConfig, tokens_BxT, mask_BxT, coef_fn: CoefFn,
                                   positions_BxT=None, key_mask_BxT=None, *, mode: str = "auto", adapter=None):
  """Book-keeping: norms and sum_i c_i s_i from the SAME captured inputs/output-grads (no 2nd backward).

  coef_fn(sq_norms_B, logp_BxT, ent_BxT) -> (c_B, extra) runs in between (IS weights, ESS, baseline live
  there); c_B is treated as a constant (stop-gradient). Returns (grads, sq_norms_B, aux) with grads shaped
  like params (param dtype; with an adapter: like the adapter) and aux = {logp_BxT, ent_BxT, leaf_sq_norms,
  coef_B, extra}.
  """
  op_norms.check_mode(mode)
  logp_BxT, ent_BxT, inputs, out_grads = capture(params, cfg, tokens_BxT, mask_BxT, positions_BxT,
                                                 key_mask_BxT, adapter)
  trainable = params if adapter is None else adapter
  sq_B, leaf_sq = _norms_from_capture(trainable, cfg, tokens_BxT, inputs, out_grads, mode)
  c_B, extra = coef_fn(sq_B, logp_BxT, ent_BxT)
  c_B = jax.lax.stop_gradient(c_B).astype(_F32)
  flat = traverse_util.flatten_dict(trainable)
  grads = {p: _leaf_weighted_grad(p, tokens_BxT, inputs, out_grads, c_B, cfg).astype(leaf.dtype)
           for p, leaf in flat.items()}
  aux = {"logp_BxT": logp_BxT, "ent_BxT": ent_BxT, "leaf_sq_norms": leaf_sq, "coef_B": c_B, "extra": extra}
  return traverse_util.unflatten_dict(grads), sq_B, aux


def weighted_logp_grad(params, cfg: model_config.ModelConfig, tokens_BxT, mask_BxT, c_B, positions_BxT=None,
                       key_mask_BxT=None, adapter=None):
  """Ordinary backward of sum_i c_i sum_t m_t log pi(y_t) (c_B constant): of params, or of the adapter."""
  c_B = jax.lax.stop_gradient(c_B).astype(_F32)

  def loss(p):
    mp, ad = (p, None) if adapter is None else (params, p)
    logp_BxT = M.token_logprobs(mp, cfg, tokens_BxT, mask_BxT, positions_BxT, key_mask_BxT, adapter=ad)
    return jnp.sum(c_B[:, None] * logp_BxT)

  return jax.grad(loss)(params if adapter is None else adapter)


def per_sequence_sq_norms_and_grad_two_pass(params, cfg: model_config.ModelConfig, tokens_BxT, mask_BxT,
                                            coef_fn: CoefFn, positions_BxT=None, key_mask_BxT=None, *,
                                            mode: str = "auto", adapter=None):
  """Same contract as per_sequence_sq_norms_and_grad, but the weighted gradient is a second full backward."""
  sq_B, aux = per_sequence_sq_norms(params, cfg, tokens_BxT, mask_BxT, positions_BxT, key_mask_BxT,
                                    mode=mode, adapter=adapter)
  c_B, extra = coef_fn(sq_B, aux["logp_BxT"], aux["ent_BxT"])
  grads = weighted_logp_grad(params, cfg, tokens_BxT, mask_BxT, c_B, positions_BxT, key_mask_BxT, adapter)
  return grads, sq_B, {**aux, "coef_B": jax.lax.stop_gradient(c_B).astype(_F32), "extra": extra}
