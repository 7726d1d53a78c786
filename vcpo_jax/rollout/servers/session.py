"""One version over a session transport (the wire, ...): pause and begin on every member, send, end, confirm
and continue; on any failure the members leave routing (the publisher resyncs them from disk)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import aiohttp

from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.servers import admin as admin_lib, checkpoint_spec

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
  """A transport could not set up or could not deliver a version within its deadline (a RuntimeError: the
  session's failure path catches it with the other errors)."""


class Transport(Protocol):
  """What the session needs of a transport (wire.WireSender is one)."""
  name: str          # in the counters: <name>_versions, <name>_failures, <name>_groups
  timeout_s: float   # the deadline of each admin call in a session
  tensors: Sequence  # the manifest (wire_pack.WireTensor), checked against the served model before any send

  def needs_setup(self, members: Sequence[str]) -> bool: ...
  async def setup(self, admin: admin_lib.AdminSession, members: Sequence[str], params: Any) -> None: ...
  async def send(self, admin: admin_lib.AdminSession, params: Any, wire_version: str, *,
                 flush_cache: bool) -> dict[str, float]: ...
  async def teardown(self, admin: Optional[admin_lib.AdminSession]) -> None: ...


async def confirm(admin: admin_lib.AdminSession, url: str, wire: str, count: Callable[[str], None]) -> None:
  """Raises unless the server reports `wire` as its weight version."""
  info = await admin.call(url, "GET", "/get_model_info")
  reported = info.get("weight_version") if isinstance(info, dict) else None
  if reported != wire:
    count("version_mismatches")
    raise Inconsistent(f"reports weight_version={reported!r} after a successful update to {wire}")


class Inconsistent(RuntimeError):
  """A server accepted the update but does not report the version it was given."""


class Session:
  """Publishes versions over `transport` to the in-sync servers; the publisher owns `out_of_sync`."""

  def __init__(self, transport: Transport, urls: Sequence[str], count: Callable[..., None], client=None,
               out_of_sync: Optional[dict] = None):
    self.transport, self.urls, self._count, self.client = transport, list(urls), count, client
    self.out_of_sync = {} if out_of_sync is None else out_of_sync
    self.admin = admin_lib.AdminSession(transport.timeout_s, count)
    self.seconds: list[float] = []  # per version: first pause -> last continue
    self.last_error: Optional[str] = None

  def check_manifest(self, reference, error_type: type) -> None:
    """Refuses a transport whose tensors differ from the served checkpoint's (before anything is sent)."""
    if reference.spec is not None:
      problem = checkpoint_spec.manifest_mismatch(self.transport.tensors, reference.spec)
      if problem is not None:
        raise error_type(f"refusing to send weights over the {self.transport.name}: {problem} "
                         f"(reference: {reference.source})")

  async def publish(self, params: Any, version: int, members: list[str], pause_mode: str,
                    pause_seconds: list[float]) -> dict[str, tuple[bool, Optional[Exception]]]:
    """`version` to `members` together; returns {url: (True, None)} for each that confirmed it, {} after a
    failure (then every member is out of routing and in out_of_sync)."""
    if not members:
      return {}
    wire, name = protocol.version_to_wire(version), self.transport.name
    t0 = time.perf_counter()
    try:
      if self.transport.needs_setup(members):
        self._count(f"{name}_groups")
      await self.transport.setup(self.admin, members, params)  # before any pause: the learner's own work
      t_pause = time.perf_counter()
      await asyncio.gather(*(self._open(u, pause_mode) for u in members))
      timings = await self.transport.send(self.admin, params, wire, flush_cache=pause_mode == "abort")
      await asyncio.gather(*(self._close(u, wire) for u in members))
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
      self._count(f"{name}_failures")
      self.last_error = repr(e)
      log.error("%s update to %s failed: %r; resyncing %s from disk", name, wire, e, members)
      await self.transport.teardown(self.admin)
      await asyncio.gather(*(self.admin.call(u, "POST", "/end_weight_update", {}) for u in members),
                           return_exceptions=True)
      for u in members:
        self.out_of_sync[u] = repr(e)
        if self.client is not None:
          self.client.set_enabled(u, False)
      return {}
    self.seconds.append(time.perf_counter() - t0)
    pause_seconds += [time.perf_counter() - t_pause] * len(members)  # paused together: open -> continue
    self._count(f"{name}_versions")
    if self.client is not None:
      self.client.gauge(f"publish_{name}_seconds", self.seconds[-1])
      for key, value in timings.items():
        self.client.gauge(f"publish_{name}_{key.removesuffix('_s')}_seconds", value)
    return {u: (True, None) for u in members}

  async def _open(self, url: str, pause_mode: str) -> None:
    """Out of routing, paused, and an update session open (SGLang refuses a session update outside one)."""
    if self.client is not None:
      self.client.set_enabled(url, False)
    await self.admin.call(url, "POST", "/pause_generation", {"mode": pause_mode})
    await self.admin.call(url, "POST", "/begin_weight_update", {})

  async def _close(self, url: str, wire: str) -> None:
    await self.admin.call(url, "POST", "/end_weight_update", {})
    await confirm(self.admin, url, wire, self._count)
    await self.admin.call(url, "POST", "/continue_generation", {})
    self.out_of_sync.pop(url, None)
    if self.client is not None:
      self.client.set_server_version(url, protocol.version_from_wire(wire))
      self.client.set_enabled(url, True)

  async def close(self) -> None:
    await self.transport.teardown(self.admin)
    await self.admin.close()
