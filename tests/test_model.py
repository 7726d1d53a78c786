"""Model: shapes, dtypes, KV-cache decode equals the full forward, log-probs vs a float64 reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M
# The model's functions run jitted, as the learner and the engine run them.
from tests.model_jit import (decode, dot_operand_dtypes, forward, hidden_states, init_params,
                             prompt_logprobs_and_logits, token_logprobs, token_logprobs_and_entropy)

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_seq_len=64)



@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.PRNGKey(0))


def test_param_tree_and_logical_axes(params):
  axes = M.param_logical_axes(CFG)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  assert {"embed_tokens", "norm", "lm_head", "layers_0", "layers_1"} == set(params)
  for path, leaf in leaves:
    spec = axes
    for k in path:
      spec = spec[k.key]
    assert len(spec) == leaf.ndim, path
  assert tuple(axes["layers_0"]["self_attn"]["q_proj"]["kernel"]) == ("embed", "q_heads")
  assert tuple(axes["layers_0"]["mlp"]["down_proj"]["kernel"]) == ("mlp", "embed")
  assert tuple(axes["embed_tokens"]) == ("vocab", "embed")


def test_tied_embeddings_have_no_head():
  cfg = model_config.ModelConfig(**{**CFG.to_dict(), "tie_word_embeddings": True})
  assert "lm_head" not in init_params(cfg, jax.random.PRNGKey(0))


def test_logprobs_are_log_softmax_of_next_token(params):
  toks = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, CFG.vocab_size)
  mask = (jnp.arange(12)[None, :] >= 4).astype(jnp.int32) * jnp.ones((3, 1), jnp.int32)
  logits = np.asarray(forward(params, CFG, toks), np.float64)
  ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  want = np.zeros((3, 12))
  want[:, 1:] = np.take_along_axis(ref[:, :-1], np.asarray(toks)[:, 1:, None], -1)[..., 0]
  want *= np.asarray(mask)
  lp, ent = token_logprobs_and_entropy(params, CFG, toks, mask)
  np.testing.assert_allclose(lp, want, atol=1e-5)
  assert np.all(np.asarray(ent)[:, :4] == 0) and np.all(np.asarray(ent)[:, 4:] > 0)


@pytest.mark.parametrize("lm_head", ["token_tiles", "plain"])
@pytest.mark.slow
def test_lm_head_choices_give_the_same_logprobs_and_grads(params, lm_head):
  """model.lm_head: token tiles (5 tokens, the last tile padded) and plain full logits equal the default
  vocabulary chunks (3 chunks of 24 over 64 columns, the last overlapping): log-probs, entropies, gradients."""
  base = model_config.ModelConfig(**{**CFG.to_dict(), "logits_chunk": 24})
  cfg = model_config.ModelConfig(**{**base.to_dict(), "lm_head": lm_head, "logits_token_tile": 5})
  toks = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, CFG.vocab_size)
  mask = (jnp.arange(12)[None, :] >= 4).astype(jnp.float32) * jnp.ones((3, 1))
  loss = lambda p, c: jnp.sum(sum(M.token_logprobs_and_entropy(p, c, toks, mask)) * jnp.arange(12.0)[None])
  grad = jax.jit(jax.grad(loss), static_argnums=1)
  for got, want in zip(token_logprobs_and_entropy(params, cfg, toks, mask),
                       token_logprobs_and_entropy(params, base, toks, mask)):
    np.testing.assert_allclose(got, want, atol=1e-5)
  for g, want in zip(jax.tree.leaves(grad(params, cfg)), jax.tree.leaves(grad(params, base))):
    scale = float(jnp.max(jnp.abs(want)))  # float32 sums in another order: 1e-5 of the leaf's scale
    np.testing.assert_allclose(g / scale, want / scale, atol=1e-5)


@pytest.mark.slow
def test_kv_cache_decode_matches_full_forward(params):
  B, P, N = 3, 5, 7
  toks = jax.random.randint(jax.random.PRNGKey(2), (B, P + N), 0, CFG.vocab_size)
  full = token_logprobs(params, CFG, toks, jnp.ones_like(toks))
  S = 16
  cache = M.init_cache(CFG, B, S)
  key_mask = jnp.zeros((B, S), bool).at[:, :P + N].set(True)
  pos = jnp.broadcast_to(jnp.arange(P + N)[None], (B, P + N))
  logits, cache = decode(params, CFG, toks[:, :P], pos[:, :P], cache, 0, key_mask)
  steps = [logits[:, -1]]
  for t in range(P, P + N - 1):
    logits, cache = decode(params, CFG, toks[:, t:t + 1], pos[:, t:t + 1], cache, t, key_mask)
    steps.append(logits[:, 0])
  logits_BxNxV = jnp.stack(steps, axis=1)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits_BxNxV), toks[:, P:, None], -1)[..., 0]
  np.testing.assert_allclose(lp, full[:, P:], atol=1e-5)


def test_left_padded_decode_matches_unpadded(params):
  """A left-padded row with shifted positions gives the same log-probs as the row alone."""
  toks = jax.random.randint(jax.random.PRNGKey(3), (1, 6), 0, CFG.vocab_size)
  pad = 3
  padded = jnp.concatenate([jnp.zeros((1, pad), toks.dtype), toks], axis=1)
  pos = jnp.maximum(jnp.arange(6 + pad)[None] - pad, 0)
  key_mask = (jnp.arange(6 + pad)[None] >= pad)
  logits = forward(params, CFG, padded, pos, key_mask)[:, pad:]
  np.testing.assert_allclose(logits, forward(params, CFG, toks), atol=1e-5)


def test_bfloat16_compute_is_close_to_float32(params):
  cfg16 = model_config.ModelConfig(**{**CFG.to_dict(), "dtype": "bfloat16"})
  toks = jax.random.randint(jax.random.PRNGKey(4), (2, 10), 0, CFG.vocab_size)
  lp32 = token_logprobs(params, CFG, toks, jnp.ones_like(toks))
  lp16 = token_logprobs(params, cfg16, toks, jnp.ones_like(toks))
  assert lp16.dtype == jnp.float32
  np.testing.assert_allclose(lp16, lp32, atol=0.1)
  p16 = init_params(model_config.ModelConfig(**{**CFG.to_dict(), "param_dtype": "bfloat16"}), jax.random.PRNGKey(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(p16))


def test_bfloat16_layers_with_a_float32_head(params):
  """model.head_dtype=float32 with bf16 compute: the final norm's output and every head GEMM are float32 while
  the layers' GEMMs stay bf16; log-probs move towards the float32 model's (the head's own bf16 error gone)."""
  bf16 = model_config.ModelConfig(**{**CFG.to_dict(), "dtype": "bfloat16"})
  f32_head = model_config.ModelConfig(**{**bf16.to_dict(), "head_dtype": "float32"})
  toks = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, CFG.vocab_size)
  mask = jnp.ones((3, 12), jnp.float32)
  assert hidden_states(params, f32_head, toks).dtype == jnp.float32
  jaxpr = jax.make_jaxpr(lambda p: M.token_logprobs(p, f32_head, toks, mask))(params).jaxpr
  dots = dot_operand_dtypes(jaxpr)
  assert ("float32", "float32") in dots and ("bfloat16", "bfloat16") in dots
  assert not any(set(d) == {"float32", "bfloat16"} for d in dots)
  want = token_logprobs(params, CFG, toks, mask)
  err = lambda cfg: float(jnp.mean(jnp.abs(token_logprobs(params, cfg, toks, mask) - want)))
  assert 0 < err(f32_head) < err(bf16)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("num_heads", 3), ("dtype", "float8"),
                                         ("head_dim", 7), ("lm_head", "fused"), ("logits_token_tile", 0),
                                         ("head_dtype", "float64")])
def test_invalid_config_names_field(field, value):
  with pytest.raises(ValueError, match=field):
    model_config.ModelConfig(**{**CFG.to_dict(), field: value})


def test_from_dict_rejects_unknown_key():
  with pytest.raises(ValueError, match="num_layerz"):
    model_config.ModelConfig.from_dict({**CFG.to_dict(), "num_layerz": 2})


@pytest.mark.parametrize("precision", ["highest", "high", "default"])
def test_every_dot_runs_at_the_configured_precision(precision):
  """Forward and backward: the learner's log-probs and their gradient use model.matmul_precision."""
  import re
  cfg = model_config.ModelConfig(matmul_precision=precision, tie_word_embeddings=True)
  params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0)))  # a jaxpr needs shapes only
  tokens = jnp.zeros((1, 4), jnp.int32)
  loss = lambda p: jnp.sum(M.token_logprobs(p, cfg, tokens, jnp.ones((1, 4))))
  text = str(jax.make_jaxpr(jax.grad(loss))(params))
  found = re.findall(r"precision=\(?Precision\.(\w+)", text)
  assert text.count("dot_general") > 8 and "precision=None" not in text
  assert set(found) == {precision.upper()}


def test_matmul_precision_is_validated():
  with pytest.raises(ValueError, match="model.matmul_precision"):
    model_config.ModelConfig(matmul_precision="tf32")


def test_prefill_outputs_from_hidden_states_equal_the_full_logits():
  """prompt_logprobs_and_logits (chunked head, 3 chunks) = log_softmax of the full forward's logits, and the
  logits at each row's own last position (right-padded prompts)."""
  cfg = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, max_seq_len=16, logits_chunk=16)
  params = init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 40)
  last_B = jnp.array([6, 3])
  x = hidden_states(params, cfg, tokens)
  logp, last = prompt_logprobs_and_logits(params, cfg, x, tokens, last_B)
  logits = np.asarray(forward(params, cfg, tokens), np.float64)
  logz = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  ref = np.concatenate([np.zeros((2, 1)), np.take_along_axis(logz[:, :-1], np.asarray(tokens)[:, 1:, None],
                                                               -1)[..., 0]], axis=1)
  np.testing.assert_allclose(logp, ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(last, logits[np.arange(2), np.asarray(last_B)], rtol=1e-5, atol=1e-6)
