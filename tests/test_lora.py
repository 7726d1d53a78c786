"""LoRA in the model: config checks, a layer with an adapter against float64 numpy, per-row adapter stacks."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.model import config as C
from vcpo_jax.model import layers, lora
from vcpo_jax.model import transformer as M


def _cfg(rank=4, alpha=8.0, scan=False, targets=C.LINEAR_MODULES, **kw):
  return C.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, scan_layers=scan,
                       lora=C.LoraConfig(rank=rank, alpha=alpha, target_modules=targets), **kw)


def _nonzero(adapter, seed=3):
  """An adapter whose B is nonzero too (a fresh one has B = 0: the model equals the base)."""
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 1000))
  return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapter)


@pytest.mark.parametrize("field,value,message", [
    ("rank", -1, "model.lora.rank must be an int >= 0"),
    ("rank", 2.5, "model.lora.rank must be an int >= 0"),
    ("alpha", 0.0, "model.lora.alpha must be a number > 0"),
    ("target_modules", ("q_proj", "lm_head"), "model.lora.target_modules: the model has no linear layer 'lm_head'"),
    ("target_modules", (), "model.lora.target_modules must be a non-empty list"),
    ("target_modules", ("q_proj", "q_proj"), "names a module twice"),
])
def test_config_errors_are_one_line_naming_the_field(field, value, message):
  with pytest.raises(ValueError, match=message) as e:
    C.LoraConfig(**{field: value})
  assert "\n" not in str(e.value)


def test_config_from_the_job_section_and_defaults():
  cfg = C.ModelConfig.from_dict({"lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}})
  assert cfg.lora == C.LoraConfig(16, 32.0, ("q_proj", "v_proj")) and cfg.lora.scale == 2.0
  assert C.ModelConfig().lora.rank == 0 and C.ModelConfig().lora.target_modules == C.LINEAR_MODULES
  assert C.ModelConfig.from_dict(cfg.to_dict()) == cfg  # a JSON-like round trip keeps it
  with pytest.raises(ValueError, match=r"unknown model.lora key\(s\) \['use_rslora'\]"):
    C.ModelConfig.from_dict({"lora": {"rank": 4, "use_rslora": True}})
  hash(cfg)  # a static jit argument


def test_dense_with_an_adapter_is_xw_plus_scaled_xab_in_float64():
  cfg = _cfg(rank=3, alpha=5.0)
  dense = layers.Dense(24, ("embed", "mlp"), True, cfg)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 16), jnp.float32)
  params = nn.unbox(dense.init(jax.random.PRNGKey(1), x)["params"])
  params["bias"] = jnp.linspace(-1, 1, 24)
  a = jax.random.normal(jax.random.PRNGKey(2), (16, 3))
  b = jax.random.normal(jax.random.PRNGKey(3), (3, 24))
  y = dense.apply({"params": params, "lora": {"lora_A": a, "lora_B": b}}, x)
  f64 = lambda t: np.asarray(t, np.float64)
  want = f64(x) @ f64(params["kernel"]) + f64(params["bias"]) + (5.0 / 3) * (f64(x) @ f64(a)) @ f64(b)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5)
  # Without the collection: exactly the base layer's formula (the rank-0 path is the plain one).
  y0 = dense.apply({"params": params}, x)
  plain = jnp.einsum("bti,io->bto", x, params["kernel"], preferred_element_type=jnp.float32,
                     precision=cfg.precision).astype(cfg.jnp_dtype) + params["bias"][None, None, :]
  np.testing.assert_array_equal(np.asarray(y0), np.asarray(plain))


def _model_and_tokens(scan, shape):
  cfg = _cfg(scan=scan)
  return cfg, M.init_params(cfg, jax.random.PRNGKey(0)), jax.random.randint(jax.random.PRNGKey(1), shape, 0, 64)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_fresh_adapter_is_the_base_and_merge_matches(scan):
  cfg, params, tokens = _model_and_tokens(scan, (2, 7))
  base = M.forward(params, cfg, tokens)
  fresh = lora.init_adapter(jax.random.PRNGKey(2), cfg)
  assert float(jnp.abs(jax.tree.leaves(fresh)[0]).max()) > 0  # A random, B zeros
  np.testing.assert_array_equal(np.asarray(M.forward(params, cfg, tokens, adapter=fresh)), np.asarray(base))
  ad = _nonzero(fresh)
  y = M.forward(params, cfg, tokens, adapter=ad)
  assert float(jnp.abs(y - base).max()) > 1e-3
  np.testing.assert_allclose(np.asarray(M.forward(lora.merge(params, ad, cfg), cfg, tokens)), np.asarray(y),
                             rtol=1e-5, atol=1e-5)


def test_only_the_targeted_layers_get_adapters_with_their_shapes():
  cfg = _cfg(rank=2, targets=("v_proj", "down_proj"))
  ad = lora.init_adapter(jax.random.PRNGKey(0), cfg)
  assert set(ad["layers_0"]) == {"self_attn", "mlp"}
  assert set(ad["layers_0"]["self_attn"]) == {"v_proj"} and set(ad["layers_0"]["mlp"]) == {"down_proj"}
  assert ad["layers_1"]["self_attn"]["v_proj"]["lora_A"].shape == (32, 2)
  assert ad["layers_1"]["self_attn"]["v_proj"]["lora_B"].shape == (2, 16)
  assert ad["layers_1"]["mlp"]["down_proj"]["lora_A"].shape == (48, 2)
  with pytest.raises(ValueError, match="model.lora.rank is 0"):
    lora.init_adapter(jax.random.PRNGKey(0), _cfg(rank=0))


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_mixed_rows_pick_their_own_adapters(scan):
  cfg, params, tokens = _model_and_tokens(scan, (5, 6))
  ads = [_nonzero(lora.init_adapter(jax.random.PRNGKey(10 + i), cfg), seed=i) for i in range(2)]
  stack = lora.empty_stack(cfg, None, 4, jnp.float32)
  stack = lora.put(lora.put(stack, 1, ads[0]), 3, ads[1])
  rows = jnp.array([1, 3, -1, 0, 1], jnp.int32)  # slot 0 is still empty: the base
  y = M.forward(params, cfg, tokens, adapter=stack, adapter_B=rows)
  want = [M.forward(params, cfg, tokens, adapter=ads[0]), M.forward(params, cfg, tokens, adapter=ads[1]),
          M.forward(params, cfg, tokens)]
  for b, pick in enumerate([0, 1, 2, 2, 0]):
    np.testing.assert_allclose(np.asarray(y[b]), np.asarray(want[pick][b]), rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(want[0] - want[1]).max()) > 1e-3


@pytest.mark.slow
def test_decode_with_a_stack_equals_the_full_forward_per_row():
  cfg = _cfg()
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  ad = _nonzero(lora.init_adapter(jax.random.PRNGKey(4), cfg))
  stack = lora.put(lora.empty_stack(cfg, None, 2, jnp.float32), 1, ad)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 64)
  positions = jnp.broadcast_to(jnp.arange(5)[None], (2, 5))
  logits, _ = M.decode(params, cfg, tokens, positions, M.init_cache(cfg, 2, 8), 0, jnp.ones((2, 8), bool),
                       adapter=stack, adapter_B=jnp.array([1, 0]))
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(M.forward(params, cfg, tokens, adapter=ad)[0]),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(M.forward(params, cfg, tokens)[1]),
                             rtol=1e-5, atol=1e-5)


def test_put_refuses_what_does_not_fit():
  cfg = _cfg()
  stack = lora.empty_stack(cfg, None, 2)
  with pytest.raises(ValueError, match="rank must match"):
    lora.put(stack, 0, lora.init_adapter(jax.random.PRNGKey(0), dataclasses.replace(cfg, lora=C.LoraConfig(8))))
  with pytest.raises(ValueError, match="target_modules must match"):
    lora.put(stack, 0, lora.init_adapter(jax.random.PRNGKey(0), _cfg(targets=("q_proj",))))
  with pytest.raises(ValueError, match="slot 2 outside"):
    lora.put(stack, 2, lora.init_adapter(jax.random.PRNGKey(0), cfg))


@pytest.mark.slow
def test_bfloat16_compute_accumulates_in_float32():
  cfg = _cfg(dtype="bfloat16")
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  ad = _nonzero(lora.init_adapter(jax.random.PRNGKey(4), cfg))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 64)
  y16 = M.forward(params, cfg, tokens, adapter=ad)
  y32 = M.forward(params, dataclasses.replace(cfg, dtype="float32"), tokens, adapter=ad)
  assert y16.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y16), np.asarray(y32), atol=0.1)


def test_an_adapter_of_another_rank_than_the_config_is_refused():
  cfg = _cfg(rank=4)
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jnp.zeros((1, 3), jnp.int32)
  for other in (_cfg(rank=2), _cfg(rank=0)):
    with pytest.raises(ValueError, match=f"with model.lora.rank={other.lora.rank}"):
      M.forward(params, other, tokens, adapter=lora.init_adapter(jax.random.PRNGKey(1), cfg))


@pytest.mark.parametrize("field,value,message", [
    ("target_modules", ("q_proj", "proj_q"), "model.lora.target_modules: the model has no linear layer 'proj_q'"),
    ("rank", -4, "model.lora.rank must be an int >= 0"),
    ("rank_typo", 4, r"unknown model.lora key\(s\) \['rank_typo'\]"),
])
def test_the_job_refuses_a_bad_lora_section_before_starting(field, value, message):
  from configs import tiny
  from vcpo_jax.job import configuration
  c = tiny.get_config()
  c.model.lora[field] = value
  with pytest.raises(ValueError, match=message) as e:
    configuration.validate_config(c)
  assert "\n" not in str(e.value)
