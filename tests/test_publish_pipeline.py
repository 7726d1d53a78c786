"""The disk publish path's export (dtype, fresh buffers), its options, and a publish refused before sending."""
import asyncio
import json
import os

import jax
import numpy as np
import pytest
import safetensors

from tests import embedded_tiny
from tests.test_validation import _config
from vcpo_jax.job import configuration
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export
from vcpo_jax.rollout.servers import weight_store
from vcpo_jax.rollout.servers.publisher import PublishError

CFG = model_config.ModelConfig(**embedded_tiny.TINY_MODEL)


def _expected(params, cfg, dtype):
  """The HF tensors the export must hold: each param (layer i of a stacked leaf), transposed where HF's layout
  is [out, in], cast once to dtype, in numpy."""
  out = {}
  for path, name, transpose in hf.tensor_names(cfg):
    arr = np.asarray(hf._get(params, path))
    if cfg.scan_layers and path[0] == "layers":
      arr = arr[int(name.split(".")[2])]
    out[name] = np.ascontiguousarray((arr.T if transpose else arr).astype(jnp_dtype(dtype)))
  return out


def jnp_dtype(dtype):
  return np.dtype(jax.numpy.dtype(dtype))


def _read(path):
  with safetensors.safe_open(os.path.join(path, "model.safetensors"), "np") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_holds_the_params_in_hf_layout_cast_once(tmp_path, dtype):
  params = embedded_tiny.tiny_params(3)
  out = hf_export.export_hf(params, CFG, str(tmp_path / "ckpt"), dtype=dtype)
  got, want = _read(out), _expected(params, CFG, dtype)
  assert sorted(got) == sorted(want)
  for name in want:  # bit for bit
    assert got[name].dtype == want[name].dtype and np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8))
  config = json.load(open(os.path.join(out, "config.json")))
  assert config["torch_dtype"] == dtype and config["vcpo_compute_dtype"] == CFG.dtype
  reimported, cfg = hf.import_hf(out)
  assert cfg.param_dtype == dtype
  for path, _, _ in hf.tensor_names(CFG):
    np.testing.assert_array_equal(np.asarray(hf._get(reimported, path), np.float32),
                                  np.asarray(hf._get(params, path)).astype(jnp_dtype(dtype)).astype(np.float32))


def test_bf16_export_is_half_the_bytes(tmp_path):
  params = embedded_tiny.tiny_params(1)
  data = {}
  for d in ("float32", "bfloat16"):
    path = os.path.join(hf_export.export_hf(params, CFG, str(tmp_path / d), dtype=d), "model.safetensors")
    with open(path, "rb") as f:
      header = int.from_bytes(f.read(8), "little")
    data[d] = os.path.getsize(path) - 8 - header
  count = sum(np.asarray(x).size for x in jax.tree.leaves(params))
  assert data == {"float32": 4 * count, "bfloat16": 2 * count}


def test_layout_is_fresh_buffers_so_the_params_may_be_donated(tmp_path):
  params = jax.device_put(embedded_tiny.tiny_params(2))
  want = _expected(jax.device_get(params), CFG, "float32")
  layout = hf_export.hf_layout(params, CFG, "float32")  # unchanged leaves (norms, biases) included
  assert layout.on_device
  for leaf in jax.tree.leaves(params):
    leaf.delete()  # what the next learner step's donation does
  got = _read(hf_export.write_hf(layout, str(tmp_path / "ckpt")))
  assert all(np.array_equal(got[k], want[k]) for k in want)


def test_unknown_export_dtype_is_refused():
  with pytest.raises(ValueError, match="export dtype must be one of .* got 'int8'"):
    hf_export.hf_layout(embedded_tiny.tiny_params(0), CFG, "int8")


# -- rollout.publish_dtype, rollout.publish_dir ------------------------------------------------------------
def _reference(tmp_path, torch_dtype):
  os.makedirs(tmp_path / torch_dtype, exist_ok=True)
  with open(tmp_path / torch_dtype / "config.json", "w") as f:
    json.dump({"torch_dtype": torch_dtype}, f)
  return str(tmp_path / torch_dtype)


def test_auto_publish_dtype_is_the_served_checkpoints(tmp_path):
  assert weight_store.publish_dtype("auto", _reference(tmp_path, "bfloat16"), "float32") == "bfloat16"
  assert weight_store.publish_dtype("auto", _reference(tmp_path, "float32"), "float32") == "float32"
  assert weight_store.publish_dtype("auto", _reference(tmp_path, "float16"), "float32") == "float32"
  assert weight_store.publish_dtype("auto", None, "float32") == "float32"  # the embedded server's start
  assert weight_store.publish_dtype("bfloat16", _reference(tmp_path, "float32"), "float32") == "bfloat16"


def test_publish_root_is_made_and_checked(tmp_path):
  assert weight_store.publish_root("", str(tmp_path)) == str(tmp_path / "weights")
  assert weight_store.publish_root(str(tmp_path / "shm" / "job"), "/x") == str(tmp_path / "shm" / "job")
  assert os.path.isdir(tmp_path / "shm" / "job") and os.listdir(tmp_path / "shm" / "job") == []


def test_an_empty_publish_dir_is_ram_backed_when_the_servers_share_the_host_and_it_has_room(tmp_path, monkeypatch):
  ram = tmp_path / "shm"
  ram.mkdir()
  monkeypatch.setattr(weight_store, "RAM_DIR", str(ram))
  free = os.statvfs(ram).f_bavail * os.statvfs(ram).f_frsize
  work = str(tmp_path / "job")
  root = weight_store.publish_root("", work, servers_are_local=True, version_bytes=1000, keep_last=3)
  assert os.path.dirname(root) == str(ram) and os.path.basename(root).startswith("vcpo-")
  assert os.path.realpath(os.path.join(work, "weights")) == root  # the versions are found where they were
  assert weight_store.publish_root("", work, servers_are_local=True, version_bytes=1000) == root  # one per job
  assert weight_store.publish_root("", str(tmp_path / "other"), servers_are_local=True) != root
  # no room for keep_last + 2 versions, or servers on other hosts: the workdir
  small = str(tmp_path / "small")
  assert weight_store.publish_root("", small, servers_are_local=True, version_bytes=free // 4,
                                   keep_last=3) == os.path.join(small, "weights")
  assert weight_store.publish_root("", small, servers_are_local=False) == os.path.join(small, "weights")
  assert weight_store.publish_root(str(tmp_path / "mine"), work, servers_are_local=True) == str(tmp_path / "mine")
  os.makedirs(tmp_path / "old" / "weights")  # a job begun on disk stays there
  assert weight_store.publish_root("", str(tmp_path / "old"), servers_are_local=True) == str(tmp_path / "old" / "weights")
  monkeypatch.setattr(weight_store, "RAM_DIR", str(tmp_path / "absent"))
  assert weight_store.publish_root("", small, servers_are_local=True) == os.path.join(small, "weights")


def test_servers_share_the_host_only_on_loopback():
  assert weight_store.servers_local([]) and weight_store.servers_local(["http://127.0.0.1:3", "http://localhost:4"])
  assert not weight_store.servers_local(["http://127.0.0.1:3", "http://node7:30000"])


def test_export_bytes_is_the_files_tensor_data(tmp_path):
  path = os.path.join(hf_export.export_hf(embedded_tiny.tiny_params(1), CFG, str(tmp_path / "c"), dtype="bfloat16"),
                      "model.safetensors")
  with open(path, "rb") as f:
    header = int.from_bytes(f.read(8), "little")
  assert hf_export.export_bytes(CFG, "bfloat16") == os.path.getsize(path) - 8 - header


@pytest.mark.parametrize("field,value,match", [
    ("rollout.publish_dtype", "float16", "must be one of"),
    ("rollout.publish_dtype", "bf16", "must be one of"),
    ("rollout.publish_dir", 3, "must be a string"),
    ("rollout.publish_dir", "/proc/no/such/dir", "must be a writable directory"),
])
def test_bad_publish_option_fails_at_validation_naming_field_and_value(field, value, match):
  with pytest.raises(ValueError, match=f"invalid config: {field}={value!r}: {match}"):
    configuration.validate_config(_config(**{field: value}))


def test_publish_dir_in_a_file_is_refused(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="rollout.publish_dir=.*file/x.*must be a writable directory"):
    weight_store.publish_root(str(tmp_path / "file" / "x"), "")


# -- a refused publish ---------------------------------------------------------------------------------------
def test_a_publish_refused_before_sending_leaves_the_routing_state_as_it_was(tmp_path):
  """An export whose shapes differ from the served model is refused before any server is called: the client's
  required_version (which keeps a restarted server out of routing until it serves that version) and routing
  stay at the last good version, as do the publisher's latest version and directory. No server runs here:
  a call to one would fail the publish with another error."""
  from vcpo_jax.rollout.client import client as client_lib
  from vcpo_jax.rollout.servers import publisher as publisher_lib
  reference = embedded_tiny.export_tiny(embedded_tiny.tiny_version(0), str(tmp_path / "start"))

  def export_wide(params, out_dir):  # the reference's tensors under a config that names another MLP width
    os.makedirs(out_dir)
    config = json.load(open(os.path.join(reference, "config.json")))
    json.dump({**config, "intermediate_size": 128}, open(os.path.join(out_dir, "config.json"), "w"))
    os.link(os.path.join(reference, "model.safetensors"), os.path.join(out_dir, "model.safetensors"))

  url = "http://127.0.0.1:9"  # nothing listens: the refusal must come first

  async def run():
    client = client_lib.RolloutClient([url], vocab_size=embedded_tiny.TINY_MODEL["vocab_size"])
    pub = publisher_lib.WeightPublisher(export_wide, str(tmp_path / "w"), client, reference_dir=reference)
    pub.adopt(1, reference)
    client.required_version = 1
    try:
      with pytest.raises(PublishError, match="intermediate_size=128.*has 64"):
        await pub.publish(None, 2)
    finally:
      await pub.close()
      await client.close()
    return client, pub

  client, pub = asyncio.run(run())
  assert client.required_version == 1 and client.is_enabled(url) and not pub.out_of_sync
  assert (pub.latest_version, pub.latest_dir) == (1, os.path.abspath(reference))
  assert pub.stats["refused_shapes"] == 1 and pub.stats["published"] == 0
  assert os.listdir(tmp_path / "w") == []


def test_a_ram_backed_root_recycles_the_deleted_versions_file_and_the_export_is_exact(tmp_path, monkeypatch):
  """Under a RAM-backed root the file of the version delete_old removes is overwritten by the next export (its
  memory stays allocated); the export holds exactly the new params, and nothing else is left behind."""
  monkeypatch.setattr(weight_store, "RAM_DIR", str(tmp_path))
  root = str(tmp_path / "vcpo-x")
  os.makedirs(root)

  def export(version):
    return weight_store.export_version(embedded_tiny.export_tiny, embedded_tiny.tiny_version(version), root, version)

  export(1), export(2)
  weight_store.delete_old(root, 1)
  spare = os.path.join(root, ".spare.safetensors")
  inode = os.stat(spare).st_ino
  path = export(3)
  assert os.stat(os.path.join(path, "model.safetensors")).st_ino == inode and not os.path.exists(spare)
  got, want = _read(path), _expected(embedded_tiny.tiny_version(3), CFG, "float32")
  assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
  assert sorted(os.listdir(root)) == ["v2", "v3"]
  weight_store.delete_old(str(tmp_path / "vcpo-x"), 2)
  assert not os.path.exists(spare)  # nothing deleted: no spare
  weight_store.delete_old(root, 1)
  assert os.path.exists(spare)
  weight_store.remove_spare(root)  # what the publisher's close does
  assert sorted(os.listdir(root)) == ["v3"]
