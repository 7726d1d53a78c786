"""Layers under scan, remat and dot_product_attention: equal to the unrolled einsum model on the same weights."""
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import traverse_util

from vcpo_jax.learner import grad_norms as G
from vcpo_jax.model import attention
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export
from vcpo_jax.model import transformer as M

L, B, T = 2, 3, 10
PLAIN = model_config.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=L, num_heads=2,
                      num_kv_heads=1, head_dim=8, max_seq_len=32, attention="einsum")
SCAN = dataclasses.replace(PLAIN, scan_layers=True, attention="xla")


@functools.lru_cache(maxsize=None)
def _setup():
  """Unrolled params with non-trivial norms/biases, their stacked copy, and rows with prompts, right padding
  (the response mask) and, in row 0, two left-pad keys (fully masked query rows)."""
  @jax.jit
  def init(key):
    params = M.init_params(PLAIN, key)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])

  # Stacked from the materialised params: inside init's program XLA may compute a value twice, once per output,
  # with a different rounding each time (fused differently), and the stacked copy would not be the params' own.
  params = init(jax.random.PRNGKey(0))
  stacked = jax.jit(M.stack_layers, static_argnums=1)(params, L)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, 7)  # few ids: repeats in the embedding rule
  t_T = jnp.arange(T)
  mask = ((t_T[None] >= jnp.array([3, 3, 1])[:, None]) & (t_T[None] < jnp.array([7, 9, 10])[:, None]))
  key_mask = t_T[None] >= jnp.array([2, 0, 0])[:, None]
  return params, stacked, tokens, mask.astype(jnp.float32), key_mask


def _loss(p, cfg, tokens, mask, key_mask):
  logp = M.token_logprobs(p, cfg, tokens, mask, key_mask_BxT=key_mask)
  return jnp.sum(logp * jnp.arange(1.0, T + 1.0)[None])


@functools.partial(jax.jit, static_argnums=1)
def _outputs(p, cfg, tokens, mask, key_mask):
  return (M.forward(p, cfg, tokens, key_mask_BxT=key_mask),
          M.token_logprobs(p, cfg, tokens, mask, key_mask_BxT=key_mask),
          jax.grad(_loss)(p, cfg, tokens, mask, key_mask))


@pytest.mark.slow
def test_stacked_layout_and_helpers():
  params, stacked, _, _, _ = _setup()
  assert set(stacked) == {"embed_tokens", "layers", "norm", "lm_head"}
  init = jax.eval_shape(lambda: M.init_params(SCAN, jax.random.PRNGKey(0)))
  assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, stacked)
  axes = M.param_logical_axes(SCAN)
  assert tuple(axes["layers"]["self_attn"]["q_proj"]["kernel"]) == ("layers", "embed", "q_heads")
  assert tuple(axes["layers"]["post_attention_layernorm"]["scale"]) == ("layers", "norm")
  back = M.unstack_layers(stacked, L)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)))


def test_scanned_equals_unrolled():
  """Logits, log-probs and grads: scan (+ jax.nn attention) vs the plain einsum path, 1e-5 in float32;
  left-padded rows (fully masked queries) stay finite and equal too."""
  params, stacked, tokens, mask, key_mask = _setup()
  logits0, logp0, grad0 = _outputs(params, PLAIN, tokens, mask, key_mask)
  logits1, logp1, grad1 = _outputs(stacked, SCAN, tokens, mask, key_mask)
  assert np.all(np.isfinite(logits1))
  np.testing.assert_allclose(logits1, logits0, atol=1e-5)
  np.testing.assert_allclose(logp1, logp0, atol=1e-5)
  for (path, g1), g0 in zip(jax.tree_util.tree_leaves_with_path(grad1),
                            jax.tree.leaves(M.stack_layers(grad0, L))):
    scale = float(jnp.max(jnp.abs(g0)))
    np.testing.assert_allclose(g1 / scale, g0 / scale, atol=1e-5, err_msg=str(path))


@pytest.mark.slow
def test_stacked_kv_cache_decode_with_per_row_index():
  """Prefill + one-token steps on a stacked cache, each row at its own slot, equal the full forward."""
  params, stacked, tokens, _, _ = _setup()
  cache = M.init_cache(SCAN, B, 16)
  assert [x.shape for x in jax.tree.leaves(cache)] == [(L, B, 16, 1, 8)] * 2
  full = _outputs(params, PLAIN, tokens, jnp.ones((B, T)), jnp.ones((B, T), bool))[0]
  step = jax.jit(functools.partial(M.decode, cfg=SCAN))
  key_mask = jnp.ones((B, 16), bool)
  pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
  logits, cache = step(stacked, tokens_BxT=tokens[:, :4], positions_BxT=pos[:, :4], cache=cache,
                       cache_index=0, key_mask_BxS=key_mask)
  np.testing.assert_allclose(logits, full[:, :4], atol=1e-5)
  rows = jnp.arange(B)
  for k in range(4):  # row b starts at call k = b (until then it rewrites slot 4 with the same token)
    slot_B = 4 + jnp.maximum(k - rows, 0)
    logits, cache = step(stacked, tokens_BxT=tokens[rows, slot_B][:, None], positions_BxT=slot_B[:, None],
                         cache=cache, cache_index=slot_B, key_mask_BxS=key_mask)
    np.testing.assert_allclose(logits[:, 0], full[rows, slot_B], atol=1e-5)


def _coef_fn(sq_B, logp_BxT, ent_BxT):
  return -jnp.sqrt(sq_B) / (1.0 + jnp.sqrt(sq_B)) + 0.1 * jnp.sum(ent_BxT, axis=1), {}


@pytest.mark.slow
def test_per_sequence_norms_and_weighted_grad_under_scan_and_remat():
  """Under scan + remat (stacked a and g), per-leaf per-sequence norms equal vmap(grad), and the book-keeping
  weighted gradient equals sum_i c_i grad_i; every stacked leaf contributes; log-probs equal the plain path."""
  params, stacked, tokens, mask, key_mask = _setup()
  cfg = dataclasses.replace(SCAN, remat="dots")

  @jax.jit
  def run(p):
    def seq_logp(p, tok_T, m_T, k_T):
      return jnp.sum(M.token_logprobs(p, cfg, tok_T[None], m_T[None], key_mask_BxT=k_T[None]))
    per_seq = jax.vmap(jax.grad(seq_logp), in_axes=(None, 0, 0, 0))(p, tokens, mask, key_mask)
    return per_seq, G.per_sequence_sq_norms_and_grad(p, cfg, tokens, mask, _coef_fn, key_mask_BxT=key_mask)

  per_seq, (grads, sq_B, aux) = run(stacked)
  np.testing.assert_allclose(aux["logp_BxT"], _outputs(params, PLAIN, tokens, mask, key_mask)[1], atol=1e-5)
  want = {"/".join(k): np.sum(np.square(np.asarray(v, np.float64).reshape(B, -1)), axis=1)
          for k, v in traverse_util.flatten_dict(per_seq).items()}
  got = aux["leaf_sq_norms"]
  assert set(got) == set(want) and "layers/self_attn/k_proj/bias" in got
  for name in want:
    assert np.all(want[name] > 0), name
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(sq_B, sum(want.values()), rtol=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(
      jax.tree.map(lambda x: jnp.tensordot(aux["coef_B"], x, axes=1), per_seq))):
    assert g.shape == w.shape, path
    scale = float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(g / scale, w / scale, atol=1e-5, err_msg=str(path))


def test_hf_export_import_of_stacked_params(tmp_path):
  """Scanned params export to the same per-layer HF tensors as the unrolled ones and import back stacked;
  an unrolled checkpoint imports into the scan layout."""
  params, stacked, _, _, _ = _setup()
  plain_dir = hf_export.export_hf(params, PLAIN, str(tmp_path / "plain"))
  scan_dir = hf_export.export_hf(stacked, SCAN, str(tmp_path / "scan"))
  t0 = safetensors.numpy.load_file(f"{plain_dir}/model.safetensors")
  t1 = safetensors.numpy.load_file(f"{scan_dir}/model.safetensors")
  assert set(t0) == set(t1) and "model.layers.1.mlp.up_proj.weight" in t1
  assert all(np.array_equal(t0[k], t1[k]) for k in t0)
  for src in (scan_dir, plain_dir):
    back, cfg = hf.import_hf(src, cfg=SCAN)
    assert cfg == SCAN
    assert jax.tree.structure(back) == jax.tree.structure(stacked)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(back)))
  assert hf.import_hf(scan_dir)[1] == SCAN  # scan_layers / attention travel in config.json


@pytest.mark.parametrize("implementation", ["xla", "auto", "cudnn"])
def test_dot_product_attention_equals_einsum_with_fully_masked_rows(implementation, caplog, monkeypatch):
  """GQA, causal + left padding: rows that see no key are finite and equal the einsum path everywhere
  (on CPU "cudnn" falls back to the einsum path with a warning)."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
  q = jax.random.normal(k1, (2, 6, 4, 8))
  k, v = jax.random.normal(k2, (2, 6, 2, 8)), jax.random.normal(k3, (2, 6, 2, 8))
  key_mask = jnp.arange(6)[None] >= jnp.array([3, 0])[:, None]
  mask = jnp.tril(jnp.ones((6, 6), bool))[None] & key_mask[:, None, :]
  monkeypatch.setattr(attention, "_warned", set())  # the fallback warns once per process

  @jax.jit
  def both(q, k, v, mask):  # one compile (op-by-op dispatch is slower)
    kw = dict(precision=jax.lax.Precision.HIGHEST, dtype=jnp.float32)
    return (attention.attend(q, k, v, mask, implementation="einsum", **kw),
            attention.attend(q, k, v, mask, implementation=implementation, **kw))

  with caplog.at_level(logging.WARNING):
    want, got = both(q, k, v, mask)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, atol=1e-6)
  if implementation == "cudnn" and jax.default_backend() != "gpu":
    assert "einsum path" in caplog.text


@pytest.mark.slow
def test_causal_flag_equals_the_boolean_mask_on_right_padded_rows(monkeypatch):
  """model.causal_flag: the learner's full forward (no key mask) hands jax.nn is_causal=True and no mask; its
  log-probs, per-sequence norms and grads equal the einsum path's on right-padded rows (the response mask)."""
  params, stacked, tokens, mask, _ = _setup()
  cfg = dataclasses.replace(SCAN, causal_flag=True)
  seen = []
  dpa = jax.nn.dot_product_attention

  def spy(*args, **kw):
    seen.append((kw.get("is_causal", False), kw.get("mask") is None))
    return dpa(*args, **kw)
  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  logp0, grad0 = jax.jit(lambda p: (M.token_logprobs(p, PLAIN, tokens, mask), jax.grad(
      lambda p: _loss(p, PLAIN, tokens, mask, None))(p)))(params)
  grads, sq_B, aux = jax.jit(lambda p: G.per_sequence_sq_norms_and_grad(p, cfg, tokens, mask, _coef_fn))(stacked)
  logp1, grad1 = jax.jit(lambda p: (M.token_logprobs(p, cfg, tokens, mask), jax.grad(
      lambda p: _loss(p, cfg, tokens, mask, None))(p)))(stacked)
  assert seen and set(seen) == {(True, True)}  # every call, the norms' capture forward included
  np.testing.assert_allclose(logp1, logp0, atol=1e-5)
  np.testing.assert_allclose(aux["logp_BxT"], logp0, atol=1e-5)
  assert np.all(np.asarray(sq_B) > 0)
  for (path, g1), g0 in zip(jax.tree_util.tree_leaves_with_path(grad1),
                            jax.tree.leaves(M.stack_layers(grad0, L))):
    scale = float(jnp.max(jnp.abs(g0)))
    np.testing.assert_allclose(g1 / scale, g0 / scale, atol=1e-5, err_msg=str(path))
  seen.clear()  # a key mask (the sampler's left pads) or a KV cache keeps the boolean mask
  jax.jit(lambda p: M.token_logprobs(p, cfg, tokens, mask, key_mask_BxT=jnp.ones((B, T), bool)))(stacked)
  assert set(seen) == {(False, False)}


@pytest.mark.slow
def test_per_sequence_norms_with_token_tiles_equal_vocabulary_chunks():
  """model.lm_head="token_tiles" (7-token tiles, the last padded) under both VCPO paths: the book-keeping
  norms and weighted gradient, and the bounded path's norms, equal those with vocabulary chunks."""
  from vcpo_jax.learner import bounded_norms
  _, stacked, tokens, mask, _ = _setup()
  chunks = dataclasses.replace(SCAN, logits_chunk=16)
  tiles = dataclasses.replace(chunks, lm_head="token_tiles", logits_token_tile=7)

  @functools.partial(jax.jit, static_argnums=1)
  def run(p, cfg):
    grads, sq_B, _ = G.per_sequence_sq_norms_and_grad(p, cfg, tokens, mask, _coef_fn)
    return grads, sq_B, bounded_norms.sq_norms_and_vjp(p, cfg, tokens, mask)[0]
  (g0, sq0, b0), (g1, sq1, b1) = run(stacked, chunks), run(stacked, tiles)
  np.testing.assert_allclose(sq1, sq0, rtol=1e-5)
  np.testing.assert_allclose(b1, b0, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a / scale, b / scale, atol=1e-5)


def test_is_causal_attention_equals_einsum_with_the_causal_mask():
  """attend(is_causal=True) on the XLA path equals the einsum reference with the causal mask (GQA); T != S is
  refused."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(4), 3)
  q = jax.random.normal(k1, (2, 6, 4, 8))
  k, v = jax.random.normal(k2, (2, 6, 2, 8)), jax.random.normal(k3, (2, 6, 2, 8))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool))[None], (2, 6, 6))
  kw = dict(precision=jax.lax.Precision.HIGHEST, dtype=jnp.float32)
  want, got = jax.jit(lambda q, k, v, m: (attention.attend(q, k, v, m, implementation="einsum", **kw),
                                          attention.attend(q, k, v, m, implementation="xla", is_causal=True,
                                                           **kw)))(q, k, v, mask)
  np.testing.assert_allclose(got, want, atol=1e-6)
  with pytest.raises(ValueError, match="T == S"):
    attention.attend(q, k[:, :4], v[:, :4], mask[:, :, :4], implementation="xla", is_causal=True, **kw)


@pytest.mark.parametrize("field,value", [("remat", "some"), ("attention", "flash"), ("scan_layers", 1),
                                         ("causal_flag", "yes")])
def test_invalid_scan_fields_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"model.{field}"):
    dataclasses.replace(PLAIN, **{field: value})
