"""Wire buckets: the packed bytes are the exporter's tensors, byte for byte, in SGLang's flattened-bucket layout."""
import dataclasses

import chex
import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from tests import embedded_tiny
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export
from vcpo_jax.model import transformer as model
from vcpo_jax.rollout.servers import wire_pack

CFG = model_config.ModelConfig(**embedded_tiny.TINY_MODEL)


def _exported(params, cfg, tmp_path):
  hf_export.export_hf(params, cfg, str(tmp_path / "x"))
  return safetensors.numpy.load_file(str(tmp_path / "x" / "model.safetensors"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scan", [False, True])
def test_buckets_hold_the_exporters_tensors_byte_for_byte(tmp_path, dtype, scan):
  cfg = dataclasses.replace(CFG, scan_layers=scan)
  params = jax.device_get(model.init_params(cfg, jax.random.PRNGKey(3)))
  want = _exported(params, cfg, tmp_path)
  tensors = wire_pack.manifest(cfg, dtype)
  assert [t.name for t in tensors] == list(dict.fromkeys(n for _, n, _ in hf.tensor_names(cfg)))
  buckets = wire_pack.plan_buckets(tensors, 20_000)
  assert len(buckets) > 2 and sorted(t.name for b in buckets for t in b) == sorted(want)
  for bucket in buckets:
    packed = np.asarray(wire_pack.pack_fn(bucket)(params))
    assert packed.dtype == np.uint8 and packed.size == sum(t.nbytes for t in bucket)
    np.testing.assert_array_equal(packed, wire_pack.pack_named(bucket, hf_export.hf_tensors(
        hf_export.hf_layout(params, cfg, dtype))))  # the host path (a learner over several processes)
    layout = hf_export.hf_layout(params, cfg, dtype)  # what the job's publisher hands the wire
    from_layout = wire_pack.pack_layout_fn(bucket, hf_export.leaf_specs(cfg))(layout.leaves)
    np.testing.assert_array_equal(np.asarray(from_layout), packed)
    got = wire_pack.unpack(packed, [t.name for t in bucket], [t.dtype for t in bucket],
                           [t.shape for t in bucket])
    for t in bucket:
      ref = want[t.name].astype(np.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
      assert got[t.name].shape == ref.shape
      assert got[t.name].tobytes() == ref.tobytes(), t.name


def test_a_bucket_packed_from_fsdp_sharded_params_reaches_one_device_whole():
  """Params sharded over 8 devices make a sharded bucket; the broadcast needs all of its bytes on one device."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
  params = jax.device_get(model.init_params(CFG, jax.random.PRNGKey(3)))
  sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(
      mesh, P("fsdp") if x.ndim and x.shape[0] % 8 == 0 else P())), params)
  (bucket,) = wire_pack.plan_buckets(wire_pack.manifest(CFG, "bfloat16"), 1 << 30)
  want = np.asarray(wire_pack.pack_fn(bucket)(params))
  packed = wire_pack.pack_fn(bucket)(sharded)
  assert not packed.sharding.is_fully_replicated  # the case: its first shard is 1/8 of the bucket
  whole = wire_pack.one_device_copy(packed)
  assert len(whole.sharding.device_set) == 1
  np.testing.assert_array_equal(np.asarray(whole), want)
  replicated = jax.device_put(want, NamedSharding(mesh, P()))
  assert len(wire_pack.one_device_copy(replicated).sharding.device_set) == 1


def _t(name, n, dtype):
  return wire_pack.WireTensor(name, (n,), dtype, (name,), None, False)


def test_a_bucket_of_mixed_dtypes_is_ordered_to_keep_every_offset_aligned():
  mixed = [_t("a", 3, "bfloat16"), _t("b", 5, "float32"), _t("c", 1, "bfloat16"), _t("d", 2, "float32")]
  with pytest.raises(ValueError, match="tensor b .* byte 6, not a multiple of 4"):
    wire_pack.bucket_offsets(mixed)
  (bucket,) = wire_pack.plan_buckets(mixed, 10**6)
  assert [t.name for t in bucket] == ["b", "d", "a", "c"]
  assert wire_pack.bucket_offsets(bucket) == [0, 20, 28, 34]
  with pytest.raises(ValueError, match="Unaligned received tensor b: byte offset 6"):
    wire_pack.unpack(np.zeros(36, np.uint8), ["a", "b"], ["bfloat16", "float32"], [[3], [5]])
  with pytest.raises(ValueError, match="the bucket has 40 bytes, its tensors 36"):
    wire_pack.unpack(np.zeros(40, np.uint8), ["b", "d", "a", "c"], ["float32", "float32", "bfloat16", "bfloat16"],
                     [[5], [2], [3], [1]])


def test_buckets_respect_their_size_and_a_large_tensor_goes_alone():
  tensors = [_t("a", 10, "float32"), _t("b", 10, "float32"), _t("big", 100, "float32"), _t("c", 1, "float32")]
  assert [[t.name for t in b] for b in wire_pack.plan_buckets(tensors, 80)] == [["a", "b"], ["big"], ["c"]]
  with pytest.raises(ValueError, match="served dtype must be one of"):
    wire_pack.manifest(CFG, "int8")


def test_params_from_hf_tensors_inverts_the_export(tmp_path):
  params = jax.device_get(model.init_params(CFG, jax.random.PRNGKey(1)))
  back = hf.params_from_hf_tensors(_exported(params, CFG, tmp_path), CFG)
  chex.assert_trees_all_equal(back, params)
  tensors = _exported(params, CFG, tmp_path)
  tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
  with pytest.raises(ValueError, match="tensor 'model.norm.weight' has shape"):
    hf.params_from_hf_tensors(tensors, CFG)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_the_embedded_receiver_replaces_exactly_the_received_tensors(tmp_path, scan):
  import types
  import jax.numpy as jnp
  from vcpo_jax.serving import weight_wire
  cfg = dataclasses.replace(CFG, scan_layers=scan)
  old = jax.device_put(model.init_params(cfg, jax.random.PRNGKey(1)))
  new = jax.device_get(model.init_params(cfg, jax.random.PRNGKey(2)))
  tensors = _exported(new, cfg, tmp_path)
  engine = types.SimpleNamespace(cfg=cfg, params=old)
  half = {n: t for i, (n, t) in enumerate(sorted(tensors.items())) if i % 2 == 0}
  got, _ = weight_wire._updated_params(engine, half)
  replaced = wire_pack.unpack(  # what the receiver now holds, read back as HF tensors
      wire_pack.pack_named(wire_pack.manifest(cfg, "float32"), hf_export.hf_tensors(hf_export.hf_layout(got, cfg))),
      *zip(*[(t.name, t.dtype, t.shape) for t in wire_pack.manifest(cfg, "float32")]))
  before = _exported(jax.device_get(old), cfg, tmp_path / "old")
  for name in tensors:
    np.testing.assert_array_equal(replaced[name], (half if name in half else before)[name])
  got_all, _ = weight_wire._updated_params(engine, tensors)
  chex.assert_trees_all_equal(got_all, new)
  chex.assert_trees_all_equal_shapes_and_dtypes(got_all, old)  # and as device arrays in the engine's layout
  assert all(isinstance(x, jnp.ndarray) for x in jax.tree.leaves(got_all))
  with pytest.raises(ValueError, match="tensor 'model.norm.weight' has shape"):
    weight_wire._updated_params(engine, {"model.norm.weight": np.zeros(3, np.float32)})
