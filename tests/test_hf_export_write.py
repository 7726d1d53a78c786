"""The pipelined export writes the same model.safetensors bytes as casting, transposing and writing in numpy."""
import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from tests.model_jit import init_params
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export

CFG = model_config.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                               num_kv_heads=2, head_dim=8, max_seq_len=64, rope_theta=1e6)
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float16": np.dtype(np.float16)}


def _cfg(**kw):
  return model_config.ModelConfig(**{**CFG.to_dict(), **kw})


def _reference(params, cfg, dtype):
  """HF name -> tensor, in hf.tensor_names order, made in numpy: layer i of a stacked leaf, [in, out] -> [out,
  in], one cast (ml_dtypes' round to nearest even for bfloat16)."""
  out = {}
  for path, name, transpose in hf.tensor_names(cfg):
    arr = np.asarray(hf._get(params, path))
    if cfg.scan_layers and path[0] == "layers":
      arr = arr[int(name.split(".")[2])]
    with np.errstate(over="ignore"):  # float16: the largest float32 becomes inf, as the export makes it
      out[name] = np.ascontiguousarray((arr.T if transpose else arr).astype(NP_DTYPES[dtype]))
  return out


def _reference_file(tensors, dtype):
  """The file bytes written by hand: 8-byte header length, the JSON header (data 8-byte aligned), the data."""
  header, offset = {}, 0
  for name, arr in tensors.items():
    header[name] = {"dtype": {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype],
                    "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  header["__metadata__"] = {"format": "pt"}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  return struct.pack("<Q", len(blob)) + blob + b"".join(arr.tobytes() for arr in tensors.values())


def _params(cfg, seed=0):
  params = init_params(cfg, jax.random.PRNGKey(seed))
  # Values that exercise the rounding: halfway cases, a subnormal, an infinity, numbers bf16 rounds up.
  specials = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1e-40, np.inf, 3.3895314e38, 0.1, -0.0],
                      np.float32)
  embed = np.array(params["embed_tokens"], np.float32)
  embed.reshape(-1)[:specials.size] = specials
  return {**params, "embed_tokens": jax.numpy.asarray(embed).astype(params["embed_tokens"].dtype)}


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_exported_file_is_byte_identical_to_the_numpy_reference(tmp_path, scan, dtype):
  cfg = _cfg(scan_layers=scan, tie_word_embeddings=not scan)
  params = _params(cfg)
  want = _reference(params, cfg, dtype)
  timings = {}
  out = hf_export.write_hf(hf_export.hf_layout(params, cfg, dtype), str(tmp_path / "ckpt"), timings=timings)
  path = os.path.join(out, hf.WEIGHTS_FILE)
  got = safetensors.numpy.load_file(path)
  assert sorted(got) == sorted(want)
  for name, arr in want.items():
    assert got[name].shape == arr.shape and got[name].tobytes() == arr.tobytes(), name
  with open(path, "rb") as f:
    assert f.read() == _reference_file(want, dtype)
  assert set(timings) == {"device_s", "host_copy_s", "write_s", "files_s"}
  assert all(v >= 0 for v in timings.values())


@pytest.mark.parametrize("scan", [False, True])
def test_leaves_converted_on_the_host_write_the_same_bytes(tmp_path, scan):
  """The several-process path: the params' own leaves, each to the host, transposed and cast there."""
  cfg = _cfg(scan_layers=scan)
  params = _params(cfg, seed=1)
  leaves = tuple(np.asarray(hf._get(params, path)) for path, _ in hf_export.leaf_specs(cfg))
  layout = hf_export.HfLayout(cfg, "bfloat16", leaves, on_device=False)
  out = hf_export.write_hf(layout, str(tmp_path / "ckpt"))
  with open(os.path.join(out, hf.WEIGHTS_FILE), "rb") as f:
    assert f.read() == _reference_file(_reference(params, cfg, "bfloat16"), "bfloat16")


def test_the_reuse_file_is_overwritten_in_place(tmp_path):
  cfg = _cfg(scan_layers=True)
  first = hf_export.export(_params(cfg, 0), cfg, str(tmp_path / "a"), dtype="bfloat16")
  out_dir = tmp_path / "b"
  os.makedirs(out_dir)
  spare = os.path.join(out_dir, hf_export.REUSE_NAME)
  os.replace(os.path.join(first, hf.WEIGHTS_FILE), spare)
  inode = os.stat(spare).st_ino
  params = _params(cfg, 2)
  hf_export.export(params, cfg, str(out_dir), dtype="bfloat16")
  path = os.path.join(out_dir, hf.WEIGHTS_FILE)
  assert os.stat(path).st_ino == inode and sorted(os.listdir(out_dir)) == ["config.json", "generation_config.json",
                                                                          "model.safetensors"]
  with open(path, "rb") as f:
    assert f.read() == _reference_file(_reference(params, cfg, "bfloat16"), "bfloat16")


def test_a_failure_mid_write_leaves_no_directory_and_the_old_one_intact(tmp_path, monkeypatch):
  cfg = _cfg(scan_layers=True)
  out = hf_export.export(_params(cfg, 0), cfg, str(tmp_path / "ckpt"), dtype="bfloat16")
  with open(os.path.join(out, hf.WEIGHTS_FILE), "rb") as f:
    before = f.read()
  real, seen = hf_export._leaf_on_host, []

  def failing(layout, j):
    seen.append(j)
    if j == 3:  # after three leaves were written at their offsets
      raise OSError("disk full")
    return real(layout, j)

  monkeypatch.setattr(hf_export, "_leaf_on_host", failing)
  with pytest.raises(OSError, match="disk full"):
    hf_export.export(_params(cfg, 1), cfg, str(tmp_path / "ckpt"), dtype="bfloat16")
  assert seen == [0, 1, 2, 3]
  assert os.listdir(tmp_path) == ["ckpt"]
  with open(os.path.join(out, hf.WEIGHTS_FILE), "rb") as f:
    assert f.read() == before


def test_each_leaf_is_its_own_fresh_buffer(tmp_path):
  """One execution per leaf (they run side by side), none of them the params' own buffer: the learner
  donates the params right after the dispatch."""
  cfg = _cfg(scan_layers=True, param_dtype="bfloat16")
  params = jax.device_put(_params(cfg))
  want = _reference(jax.device_get(params), cfg, "bfloat16")
  layout = hf_export.hf_layout(params, cfg, "bfloat16")  # every leaf unchanged but the transposed ones
  pointers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}
  assert not pointers & {x.unsafe_buffer_pointer() for x in layout.leaves}
  for leaf in jax.tree.leaves(params):
    leaf.delete()
  got = safetensors.numpy.load_file(os.path.join(hf_export.write_hf(layout, str(tmp_path / "c")), hf.WEIGHTS_FILE))
  assert all(got[k].tobytes() == want[k].tobytes() for k in want)


@pytest.mark.parametrize("scan", [False, True])
def test_a_recycled_layout_takes_the_next_version_and_the_params_may_still_be_donated(tmp_path, scan):
  """The previous version's layout buffers are donated to the next one (it is deleted); the new leaves are
  still not the params' buffers, and the file is the same bytes as a fresh layout's."""
  cfg = _cfg(scan_layers=scan)
  first = hf_export.hf_layout(_params(cfg, 0), cfg, "bfloat16")
  hf_export.write_hf(first, str(tmp_path / "v1"))
  params = jax.device_put(_params(cfg, 1))
  want = _reference_file(_reference(jax.device_get(params), cfg, "bfloat16"), "bfloat16")
  old_pointers = {x.unsafe_buffer_pointer() for x in first.leaves}
  layout = hf_export.hf_layout(params, cfg, "bfloat16", recycle=first)
  assert all(x.is_deleted() for x in first.leaves)
  assert {x.unsafe_buffer_pointer() for x in layout.leaves} == old_pointers  # written in place
  for leaf in jax.tree.leaves(params):
    leaf.delete()
  with open(os.path.join(hf_export.write_hf(layout, str(tmp_path / "v2")), hf.WEIGHTS_FILE), "rb") as f:
    assert f.read() == want


def test_a_layout_that_does_not_fit_is_not_recycled(tmp_path):
  cfg = _cfg(scan_layers=True)
  params = _params(cfg, 1)
  other_dtype = hf_export.hf_layout(_params(cfg, 0), cfg, "float32")
  other_model = hf_export.hf_layout(_params(_cfg(scan_layers=False), 0), _cfg(scan_layers=False), "bfloat16")
  deleted = hf_export.hf_layout(_params(cfg, 0), cfg, "bfloat16")
  deleted.leaves[0].delete()
  for spare in (other_dtype, other_model, deleted):
    layout = hf_export.hf_layout(params, cfg, "bfloat16", recycle=spare)
    assert not any(x.is_deleted() for x in spare.leaves[1:])
    got = safetensors.numpy.load_file(os.path.join(hf_export.write_hf(layout, str(tmp_path / "c")), hf.WEIGHTS_FILE))
    want = _reference(params, cfg, "bfloat16")
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


class _Publisher:
  """Writes each layout it is given; refuses the versions in `refuse` after reading it."""

  def __init__(self, root, refuse=()):
    self.root, self.refuse, self.layouts = root, set(refuse), []

  async def publish(self, layout, version):
    self.layouts.append(layout)
    hf_export.write_hf(layout, os.path.join(self.root, f"v{version}"))
    if version in self.refuse:
      raise RuntimeError(f"v{version} refused")


def test_http_backend_writes_each_version_into_the_last_published_layout(tmp_path):
  """HttpBackend.publish: version 2's layout takes version 1's buffers once v1 is live; a refused version's
  layout is never recycled (a failed publish's readers may still hold it)."""
  import asyncio
  import types
  from vcpo_jax.rollout import http_backend
  from vcpo_jax.rollout.servers import background
  cfg = _cfg(scan_layers=True)
  backend = object.__new__(http_backend.HttpBackend)
  backend.ctx, backend.export_dtype, backend.lora = types.SimpleNamespace(model_cfg=cfg), "bfloat16", None
  backend._pending, backend._background, backend._spare = background.BackgroundPublish(), True, None
  backend._publisher = _Publisher(str(tmp_path), refuse={2})
  backend._sched = types.SimpleNamespace(set_served_version=lambda v: None)

  async def run():
    await backend.publish(1, _params(cfg, 1))
    await backend.publish(2, _params(cfg, 2))  # waits for v1, then writes into its buffers
    with pytest.raises(RuntimeError, match="v2 refused"):
      await backend.publish(3, _params(cfg, 3))
    await backend.publish(3, _params(cfg, 3))  # v2 was refused: fresh buffers again
    await backend.wait_published()

  asyncio.run(run())
  v1, v2, v3 = backend._publisher.layouts
  assert all(x.is_deleted() for x in v1.leaves) and not any(x.is_deleted() for x in v2.leaves + v3.leaves)
  for version in (2, 3):
    with open(os.path.join(tmp_path, f"v{version}", hf.WEIGHTS_FILE), "rb") as f:
      assert f.read() == _reference_file(_reference(_params(cfg, version), cfg, "bfloat16"), "bfloat16")
