"""Sharding on 8 fake CPU devices: params placed per the logical rules; sharded forward equals unsharded."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import skip_if_not_enough_devices
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer as M
from vcpo_jax.parallel import sharding as S
from tests import model_jit

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_seq_len=64)


def _expected_spec(logical, rules):
  table = dict(rules)
  return P(*[table[name] for name in logical])


@pytest.mark.slow
@skip_if_not_enough_devices(8)
@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": -1}, {"fsdp": 4, "tensor": 2}])
def test_sharded_state_follows_rules_and_forward_matches(shape):
  mesh = S.make_mesh(shape)
  params, shardings = S.create_sharded(lambda: M.init_params(CFG, jax.random.PRNGKey(0), boxed=True), mesh)
  axes = M.param_logical_axes(CFG)
  flat_axes = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, P))
  flat_params = jax.tree_util.tree_leaves(params)
  assert len(flat_axes) == len(flat_params)
  for logical, leaf in zip(flat_axes, flat_params):
    assert leaf.sharding.spec == _expected_spec(logical, S.DEFAULT_RULES), (logical, leaf.sharding.spec)
  unsharded = model_jit.init_params(CFG, jax.random.PRNGKey(0))
  for a, b in zip(jax.tree_util.tree_leaves(unsharded), flat_params):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  toks = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, CFG.vocab_size)
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(S.DEFAULT_RULES)):
    fn = jax.jit(lambda p, t: M.token_logprobs(p, CFG, t, jnp.ones_like(t)))
    sharded = fn(params, jax.device_put(toks, S.batch_sharding(mesh)))
  want = model_jit.token_logprobs(unsharded, CFG, toks, jnp.ones_like(toks))
  np.testing.assert_allclose(sharded, want, atol=1e-5)


def test_mesh_errors_name_the_problem():
  with pytest.raises(ValueError, match="model"):
    S.make_mesh({"model": 2})
  with pytest.raises(ValueError, match="devices"):
    S.make_mesh({"data": 3, "tensor": 5})
