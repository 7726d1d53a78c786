"""The weight wire's sender: one torch group with every server, buckets broadcast from the learner, deadlines.

Per version, for the servers in the group (the publisher pauses them and opens the update first):
for each bucket, `/update_weights_from_distributed` is posted to every server concurrently with the broadcast
(the call blocks until the bytes arrive); `weight_version` and `flush_cache` ride on the last bucket only, so a
server reports the new version only once every tensor landed. Any failure raises WireError; the publisher then
tears the group down and resyncs those servers from disk.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.parse
from typing import Any, Optional, Sequence

import jax
import numpy as np

from vcpo_jax.model import config as config_lib
from vcpo_jax.model import hf_export
from vcpo_jax.rollout.servers import admin as admin_lib
from vcpo_jax.rollout.servers import session, wire_group, wire_pack

GROUP_NAME = "vcpo_weights"
BACKENDS = ("auto", "gloo", "nccl")
log = logging.getLogger(__name__)


class WireError(session.TransportError):
  """A group could not be formed or a bucket did not reach every server within its deadline."""


def resolve_backend(backend: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"rollout.wire_backend must be one of {BACKENDS}, got {backend!r}")
  if backend != "auto":
    return backend
  return "nccl" if jax.default_backend() == "gpu" else "gloo"


def master_address(urls: Sequence[str]) -> str:
  """Where the servers reach the learner's group store: loopback when every server is local, else this
  host's name (rollout.wire_master_address overrides)."""
  hosts = {urllib.parse.urlparse(u).hostname for u in urls}
  if hosts <= {"127.0.0.1", "localhost", "::1"}:
    return "127.0.0.1"
  return socket.getfqdn()


class WireSender:
  """Rank 0 of the weight group; packs each bucket on the learner's devices and broadcasts it (a
  session.Transport)."""
  name = "wire"

  def __init__(self, model_cfg: config_lib.ModelConfig, dtype: str, *, bucket_mb: float = 512.0,
               backend: str = "auto", timeout_s: float = 60.0, master_address: str = "127.0.0.1"):
    if not bucket_mb > 0 or not timeout_s > 0:
      raise ValueError(f"rollout.wire_bucket_mb and rollout.wire_timeout_s must be > 0, got {bucket_mb!r}, "
                       f"{timeout_s!r}")
    self.torch = wire_group.require_torch()
    self.backend = resolve_backend(backend)
    self.cfg, self.dtype = model_cfg, dtype
    self.tensors = wire_pack.manifest(model_cfg, dtype)
    self.buckets = wire_pack.plan_buckets(self.tensors, int(bucket_mb * 2**20))
    self.timeout_s, self.master_address = timeout_s, master_address
    self.members: list[str] = []
    self._pg: Any = None
    self._pack_fns: dict[Any, Any] = {}
    self._prefetched: Optional[asyncio.Task] = None
    self.bytes_per_version = sum(t.nbytes for t in self.tensors)

  # -- the group ---------------------------------------------------------------------------------
  async def ensure_group(self, admin: admin_lib.AdminSession, urls: Sequence[str]) -> None:
    """A group of exactly `urls` (rank i + 1 for server i; one TP rank each); rebuilt when members change."""
    urls = list(urls)
    if self._pg is not None and urls == self.members:
      return
    await self.teardown(admin)
    port = wire_group.free_port(self.master_address)
    world = len(urls) + 1
    join = asyncio.create_task(asyncio.to_thread(wire_group.join, self.master_address, port, 0, world, GROUP_NAME,
                                                 self.backend, self.timeout_s))
    payload = lambda i: {"master_address": self.master_address, "master_port": port, "rank_offset": i + 1,
                         "world_size": world, "group_name": GROUP_NAME, "backend": self.backend}
    calls = [admin.call(u, "POST", "/init_weights_update_group", payload(i)) for i, u in enumerate(urls)]
    results = await asyncio.gather(join, *calls, return_exceptions=True)
    errors = [f"{who}: {r!r}" for who, r in zip(["learner"] + urls, results) if isinstance(r, BaseException)]
    errors += [f"{u}: {r!r:.200}" for u, r in zip(urls, results[1:])
               if not isinstance(r, BaseException) and not (isinstance(r, dict) and r.get("success"))]
    if errors:
      if not isinstance(results[0], BaseException):
        wire_group.destroy(results[0])
      raise WireError("the weight group did not form: " + "; ".join(errors))
    self._pg, self.members = results[0], urls

  def needs_setup(self, members: Sequence[str]) -> bool:
    return self._pg is None or self.members != list(members)

  async def setup(self, admin: admin_lib.AdminSession, members: Sequence[str], params: Any) -> None:
    """The group of exactly `members`, and the first bucket packed (before any server pauses)."""
    await self.ensure_group(admin, members)
    await self.prefetch(params)

  async def teardown(self, admin: Optional[admin_lib.AdminSession]) -> None:
    """Destroys our side, then asks the members to drop theirs (best effort: a dead one cannot answer)."""
    pg, members = self._pg, self.members
    self._pg, self.members, self._prefetched = None, [], None
    if pg is None:
      return
    await asyncio.to_thread(wire_group.destroy, pg)
    if admin is not None:
      await asyncio.gather(*(admin.call(u, "POST", "/destroy_weights_update_group", {"group_name": GROUP_NAME})
                             for u in members), return_exceptions=True)

  # -- one version -------------------------------------------------------------------------------
  def _bucket_tensor(self, params: Any, i: int):
    """Bucket i as a torch uint8 tensor on the broadcast's device, packed on the learner's devices. `params`
    is the publisher's payload: the HF layout the disk export also writes (hf_export.HfLayout), or params."""
    bucket = self.buckets[i]
    layout = params if isinstance(params, hf_export.HfLayout) else None
    if layout is not None and layout.dtype != self.dtype:
      raise WireError(f"the layout is in {layout.dtype}, the wire sends {self.dtype}")
    if layout is None and not all(not isinstance(x, jax.Array) or x.is_fully_addressable
                                  for x in jax.tree.leaves(params)):
      layout = hf_export.hf_layout(params, self.cfg, self.dtype)  # over several processes: not on one device
    if layout is not None and not layout.on_device:  # gathered to process 0 one tensor at a time, as the export
      return self.torch.from_numpy(wire_pack.pack_named(bucket, hf_export.hf_tensors(layout)))
    key = (i, layout is not None)
    if key not in self._pack_fns:
      self._pack_fns[key] = (wire_pack.pack_layout_fn(bucket, hf_export.leaf_specs(layout.cfg)) if layout
                             else wire_pack.pack_fn(bucket))
    packed = self._pack_fns[key](layout.leaves if layout is not None else params)
    packed = wire_pack.one_device_copy(packed)
    on_host = all(d.platform == "cpu" for d in packed.devices())
    if self.backend == "nccl" or on_host:  # DLPack hands the buffer to torch without a copy
      return self.torch.utils.dlpack.from_dlpack(packed)
    return self.torch.from_numpy(np.array(jax.device_get(packed)))  # gloo from a GPU: through host memory

  def prefetch(self, params: Any) -> asyncio.Task:
    """Starts packing the first bucket (before the servers are paused: packing is the learner's work)."""
    self._prefetched = asyncio.create_task(asyncio.to_thread(self._bucket_tensor, params, 0))
    return self._prefetched

  async def send(self, admin: admin_lib.AdminSession, params: Any, wire_version: str, *,
                 flush_cache: bool) -> dict[str, float]:
    """Every bucket to every member; returns timings. Raises WireError naming the bucket and the servers."""
    if self._pg is None:
      raise WireError("no weight group (ensure_group first)")
    pack_s = bcast_s = 0.0
    pending, self._prefetched = self._prefetched or self.prefetch(params), None
    for i, bucket in enumerate(self.buckets):
      last = i == len(self.buckets) - 1
      t0 = time.perf_counter()
      tensor = await pending
      # the next bucket is packed while this one travels (the servers wait paused meanwhile)
      pending = None if last else asyncio.create_task(asyncio.to_thread(self._bucket_tensor, params, i + 1))
      t1 = time.perf_counter()
      body = {"names": [t.name for t in bucket], "dtypes": [t.dtype for t in bucket],
              "shapes": [list(t.shape) for t in bucket], "group_name": GROUP_NAME,
              "load_format": "flattened_bucket", "flush_cache": flush_cache and last,
              "abort_all_requests": False}
      if last:
        body["weight_version"] = wire_version
      calls = [admin.call(u, "POST", "/update_weights_from_distributed", body) for u in self.members]
      cast = asyncio.to_thread(wire_group.broadcast, self._pg, tensor, self.timeout_s)
      results = await asyncio.gather(cast, *calls, return_exceptions=True)
      bcast_s += time.perf_counter() - t1
      pack_s += t1 - t0
      failed = [f"{who}: {r!r:.300}" for who, r in zip(["broadcast"] + self.members, results)
                if isinstance(r, BaseException)]
      failed += [f"{u}: {r!r:.300}" for u, r in zip(self.members, results[1:])
                 if not isinstance(r, BaseException) and not (isinstance(r, dict) and r.get("success") is True)]
      if failed:
        if pending is not None:
          await asyncio.gather(pending, return_exceptions=True)  # its thread runs to the end anyway
        raise WireError(f"bucket {i + 1}/{len(self.buckets)} failed: " + "; ".join(failed))
    return {"pack_s": pack_s, "broadcast_s": bcast_s}
