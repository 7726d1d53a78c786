"""The same-node transport (rollout.publish=tensor): SGLang's /update_weights_from_tensor with handles, not bytes.

Per bucket (wire_pack's buckets of the export's HF tensors, in the served dtype) the learner packs the bytes,
before any server pauses, into one buffer the servers can map: on CPU a torch tensor in shared memory (torch.multiprocessing's
file_system strategy: the payload names a /dev/shm file), on GPU the packed device buffer itself, handed to
torch through DLPack (the payload then carries a CUDA IPC handle; UNTESTED: no GPU in the test suite). The
payload is SGLang's: `serialized_named_tensors`, one base64 ForkingPickler dump per TP rank of
[(HF name, tensor)], each tensor a view into the bucket's buffer. (SGLang's `flattened_bucket` format needs
its own metadata class on the sender, so the named list is sent.) The buffers live until every server has
answered; `weight_version` and `flush_cache` ride on the last bucket only, as on the wire. torch is needed,
and imported, only when this transport is chosen.
"""
from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

from vcpo_jax.model import config as config_lib
from vcpo_jax.model import hf_export
from vcpo_jax.rollout.servers import admin as admin_lib
from vcpo_jax.rollout.servers import session, wire_pack

INSTALL_HINT = ("rollout.publish=tensor needs torch (shared-memory and CUDA IPC handles): pip install torch "
                "(the same version the SGLang servers run)")


class TensorError(session.TransportError):
  """A bucket was not loaded by every server within the deadline."""


def require_torch():
  """torch with the file_system sharing strategy (a handle any process on the host can open), or an
  ImportError that says how to install it."""
  try:
    import torch
    import torch.multiprocessing as mp
  except ImportError as e:
    raise ImportError(f"{INSTALL_HINT} ({e})") from e
  mp.set_sharing_strategy("file_system")
  return torch


def serialize(named: list, tp_size: int = 1) -> list[str]:
  """SGLang's serialized_named_tensors: one base64 ForkingPickler dump per TP rank (the same handles)."""
  from multiprocessing.reduction import ForkingPickler
  buf = io.BytesIO()
  ForkingPickler(buf).dump(named)
  return [base64.b64encode(buf.getvalue()).decode()] * tp_size


def named_views(torch, buffer_u8, bucket: Sequence[wire_pack.WireTensor]) -> list:
  """[(HF name, tensor)]: each a view into the bucket's buffer, at wire_pack's offsets."""
  out = []
  for t, offset in zip(bucket, wire_pack.bucket_offsets(bucket)):
    dtype = getattr(torch, t.dtype)
    out.append((t.name, buffer_u8[offset:offset + t.nbytes].view(dtype).view(t.shape)))
  return out


class TensorSender:
  """Packs each bucket into a buffer the servers map, and posts its handles (a session.Transport)."""
  name = "tensor"

  def __init__(self, model_cfg: config_lib.ModelConfig, dtype: str, *, bucket_mb: float = 512.0,
               timeout_s: float = 60.0, tp_size: int = 1):
    if not bucket_mb > 0 or not timeout_s > 0:
      raise ValueError(f"rollout.wire_bucket_mb and rollout.wire_timeout_s must be > 0, got {bucket_mb!r}, "
                       f"{timeout_s!r}")
    self.torch = require_torch()
    self.cfg, self.dtype, self.timeout_s, self.tp_size = model_cfg, dtype, timeout_s, tp_size
    self.tensors = wire_pack.manifest(model_cfg, dtype)
    self.buckets = wire_pack.plan_buckets(self.tensors, int(bucket_mb * 2**20))
    self._pack_fns: dict[int, Any] = {}
    self.members: list[str] = []
    self._buffers: list = []
    self.last_pack_s = 0.0

  def needs_setup(self, members: Sequence[str]) -> bool:
    return False  # no group: every call carries its own handles

  async def setup(self, admin: admin_lib.AdminSession, members: Sequence[str], params: Any) -> None:
    """Every bucket packed into its buffer before any server pauses: the pause covers only the loads."""
    self.members = list(members)
    layout = params if isinstance(params, hf_export.HfLayout) else hf_export.hf_layout(params, self.cfg, self.dtype)
    t0 = time.perf_counter()
    self._buffers = [await asyncio.to_thread(self._buffer, layout, i) for i in range(len(self.buckets))]
    self.last_pack_s = time.perf_counter() - t0

  async def teardown(self, admin: Optional[admin_lib.AdminSession]) -> None:
    self._buffers = []  # the shared memory is released with the last reference

  def _buffer(self, layout: hf_export.HfLayout, i: int):
    """Bucket i's bytes in a buffer another process can map: shared memory on the host, or (GPU) the packed
    device buffer through DLPack."""
    bucket = self.buckets[i]
    if layout.dtype != self.dtype:
      raise TensorError(f"the layout is in {layout.dtype}, this transport sends {self.dtype}")
    if not layout.on_device:  # over several processes: gathered to process 0 as the export does
      host = wire_pack.pack_named(bucket, hf_export.hf_tensors(layout))
    else:
      if i not in self._pack_fns:
        self._pack_fns[i] = wire_pack.pack_layout_fn(bucket, hf_export.leaf_specs(layout.cfg))
      packed = wire_pack.one_device_copy(self._pack_fns[i](layout.leaves))
      if not all(d.platform == "cpu" for d in packed.devices()):
        return self.torch.utils.dlpack.from_dlpack(packed)  # UNTESTED on GPU: a CUDA IPC handle when pickled
      host = np.asarray(jax.device_get(packed))
    shared = self.torch.empty(host.size, dtype=self.torch.uint8).share_memory_()
    shared.numpy()[:] = host
    return shared

  async def send(self, admin: admin_lib.AdminSession, params: Any, wire_version: str, *,
                 flush_cache: bool) -> dict[str, float]:
    """Every bucket's handles to every member (the buffers setup packed); returns timings. Raises TensorError
    naming the bucket and the servers."""
    if len(self._buffers) != len(self.buckets):
      raise TensorError("no packed buckets (setup first)")
    t0 = time.perf_counter()
    for i, (bucket, buffer) in enumerate(zip(self.buckets, self._buffers)):
      last = i == len(self.buckets) - 1
      body = {"serialized_named_tensors": serialize(named_views(self.torch, buffer, bucket), self.tp_size),
              "flush_cache": flush_cache and last, "abort_all_requests": False}
      if last:
        body["weight_version"] = wire_version
      results = await self._post(admin, i, body)
      failed = [f"{u}: {r!r:.300}" for u, r in zip(self.members, results)
                if isinstance(r, BaseException) or not (isinstance(r, dict) and r.get("success") is True)]
      if failed:
        self._buffers = []
        raise TensorError(f"bucket {i + 1}/{len(self.buckets)} failed: " + "; ".join(failed))
    self._buffers = []  # every member answered: the handles are no longer needed
    return {"pack_s": self.last_pack_s, "load_s": time.perf_counter() - t0}

  async def _post(self, admin: admin_lib.AdminSession, i: int, body: dict) -> list:
    """Bucket i's call to every member at once; each answer or its exception."""
    return await asyncio.gather(*(admin.call(u, "POST", "/update_weights_from_tensor", body)
                                  for u in self.members), return_exceptions=True)
