"""Weight publisher: the per-version protocol written once, over a transport; confirm, and resync the failures.

Per version, every server is taken out of routing and paused, the version is sent, its arrival confirmed
(/get_model_info reports it), and the server continued and routed to again. A server whose update fails, and
one found out of sync, stays out of routing until a resync from a disk export of the latest version.
Transports: disk (disk.py: export -> update_weights_from_disk per server; the first load, restarts and
resyncs always go by disk) and session transports such as the wire (wire.py, rollout.publish=wire): pause and
begin on every in-sync server, send, then end, confirm and continue, all servers together.

Default pause (`pause_mode="abort"`): aborted requests come back with their partial output and the client
resumes them as prompt + partial output, so every token is computed by exactly the weights its version tag
names, and the prefix cache is flushed with each update. `pause_mode="in_place"` keeps requests running across
the update (flush_cache false; the servers need --disable-radix-cache), but the resumed tokens then attend to
KV computed by the old weights: see docs/sglang.md.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any, Iterable, Optional, Union

import aiohttp

from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.client import client as client_lib
from vcpo_jax.rollout.servers import admin, disk, lora, reference as reference_lib, session, weight_store

PAUSE_MODES = ("abort", "in_place")
log = logging.getLogger(__name__)


class PublishError(RuntimeError):
  """The update cannot succeed: every server rejected it (a 4xx), its shapes do not fit the model, or a
  server serves another model than the job's starting weights."""


class WeightPublisher:
  """Publishes learner versions to every rollout server; takes failed servers out of rotation until re-synced.

  `client_or_urls` is a RolloutClient (its routing then skips updating and out-of-sync servers, its
  liveness checks keep a restarted server out until it runs the required version, and the publisher's
  counters appear in its stats) or a plain list of server urls. `reference_dir` holds the job's starting
  weights (the directory the servers were launched on): every export and every served model is checked
  against its shapes. Without it, the served model_path if readable here, else the first export. `wire` is a
  session transport (session.Transport, e.g. wire.WireSender) for the versions after the first.
  """

  def __init__(self, export_fn: weight_store.ExportFn, root_dir: str,
               client_or_urls: Union[client_lib.RolloutClient, Iterable[str]], *, keep_last: int = 3,
               timeout: float = 300.0, resync_interval: float = 5.0, pause_mode: str = "abort",
               update_attempts: int = 3, reference_dir: Optional[str] = None,
               wire: Optional[session.Transport] = None, adapters: Optional[lora.AdapterSync] = None):
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
      raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if not timeout > 0 or not resync_interval > 0:
      raise ValueError(f"timeout and resync_interval must be > 0, got {timeout!r}, {resync_interval!r}")
    if pause_mode not in PAUSE_MODES:
      raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    self._export_fn, self.root_dir = export_fn, os.path.abspath(root_dir)
    os.makedirs(self.root_dir, exist_ok=True)
    if isinstance(client_or_urls, client_lib.RolloutClient):
      self.client, self.urls = client_or_urls, client_or_urls.urls
    else:
      self.client, self.urls = None, [u.rstrip("/") for u in client_or_urls]
    if not self.urls:
      raise ValueError("client_or_urls must name at least one server")
    self.keep_last, self.timeout, self.resync_interval = keep_last, timeout, resync_interval
    self.pause_mode, self.update_attempts = pause_mode, update_attempts
    self.latest_version: Optional[int] = None
    self.latest_dir: Optional[str] = None
    self.latest_dir_version: Optional[int] = None  # the version latest_dir holds (session versions have none)
    self.out_of_sync: dict[str, str] = {}  # url -> last error
    self.stats = {"published": 0, "server_failures": 0, "resynced": 0, "version_mismatches": 0,
                  "cache_not_flushed_retries": 0, "refused_shapes": 0, "stale_connection_retries": 0,
                  "disk_resync_exports": 0}
    self.pause_seconds: list[float] = []  # per server and update: pause -> continue
    self.reference = reference_lib.Reference(reference_dir)
    weight_store.remove_unchecked_exports(self.root_dir)
    self._lock = asyncio.Lock()
    self._admin = admin.AdminSession(timeout, self._count)
    self._resync_task: Optional[asyncio.Task] = None
    self.wire, self.adapters = wire, adapters
    if adapters is not None:
      if wire is not None or self.client is None:
        raise ValueError("LoRA adapters are published by disk or tensor to a RolloutClient's servers, "
                         "not over the wire")
      adapters.bind(self.out_of_sync, self._count)
      self.stats.update({"adapter_loads": 0, "adapter_unloads": 0, "adapter_failures": 0})
    self.session = None if wire is None else session.Session(wire, self.urls, self._count, self.client,
                                                                  self.out_of_sync)
    if self.session is not None:
      self.stats.update({f"{wire.name}_versions": 0, f"{wire.name}_failures": 0, f"{wire.name}_groups": 0})
      self.session.check_manifest(self.reference, PublishError)

  @property
  def wire_seconds(self) -> list[float]:
    """Per session version: first pause -> last continue."""
    return self.session.seconds if self.session is not None else []

  @property
  def last_wire_error(self) -> Optional[str]:
    return self.session.last_error if self.session is not None else None

  def _count(self, key: str, n: int = 1) -> None:
    self.stats[key] += n
    if self.client is not None:
      self.client.count(f"publish_{key}", n)

  async def publish(self, params: Any, version: int) -> dict[str, bool]:
    """Sends `version` to every server concurrently; returns {url: success}."""
    protocol.version_to_wire(version)  # validates
    if self.latest_version is not None and version < self.latest_version:
      raise ValueError(f"version must be >= the last published {self.latest_version}, got {version}")
    async with self._lock:
      if self.reference.spec is None and self.adapters is None:
        await self.reference.adopt_served(self._admin, self.urls)
      if self.adapters is not None:  # the base stays as served: only the adapter moves
        results = await self._publish_adapter(params, version)
        path = f"adapter {protocol.adapter_name(version)}"
      elif self.session is not None and self.latest_dir is not None:
        self._require(version)
        behind = self._needs_sync()
        by_url = await self.session.publish(params, version, [u for u in self.urls if u not in behind],
                                            self.pause_mode, self.pause_seconds)
        behind = [u for u in self.urls if u not in by_url]
        if behind:  # out of sync before, or failed by the session: from a disk export of this version
          self._count("disk_resync_exports")
          path = await self._export(params, version)
          results = await asyncio.gather(*(self._sync(u, version, path, check_model=True) for u in behind))
          by_url.update(zip(behind, results))
          self._count("resynced", sum(ok for ok, _ in results))
        results = [by_url[u] for u in self.urls]
        path = f"the {self.wire.name} ({protocol.version_to_wire(version)})"
      else:
        path = await self._export(params, version)  # a refusal raises here, before any routing state moves
        self._require(version)
        results = await asyncio.gather(*(self._sync(url, version, path) for url in self.urls))
      self.latest_version = version
      if self.adapters is None:
        await asyncio.to_thread(weight_store.delete_old, self.root_dir, self.keep_last)
    self._count("published")
    if not any(ok for ok, _ in results) and all(isinstance(err, admin.Rejected) for _, err in results):
      raise PublishError(f"every server rejected {path}: " + "; ".join(
          f"{url}: {err}" for url, (_, err) in zip(self.urls, results)))
    if self._resync_task is None:
      self._resync_task = asyncio.create_task(self._resync_loop())
    return {url: ok for url, (ok, _) in zip(self.urls, results)}

  async def _publish_adapter(self, adapter: Any, version: int) -> list[tuple[bool, Optional[Exception]]]:
    """The adapter of `version` to the in-sync servers; the others resynced to it."""
    behind = self._needs_sync()
    by_url = await self.adapters.publish(adapter, version, [u for u in self.urls if u not in behind])
    for url in behind:
      ok = await self.adapters.resync(url)
      by_url[url] = (ok, None if ok else RuntimeError(self.out_of_sync.get(url, "resync failed")))
      self._count("resynced", int(ok))
    return [by_url[u] for u in self.urls]

  def _require(self, version: int) -> None:
    """From now on a server that comes back (restarted) is routed to only once it serves `version`: called
    when the version is about to be sent, never for one refused before."""
    if self.client is not None:
      self.client.required_version = version

  def adopt(self, version: int, path: str) -> None:
    """The servers were started on `path` as `version` (the embedded servers): no first load is needed, so
    a session transport sends the next version, and a resync sends `path` until a newer export."""
    protocol.version_to_wire(version)
    self.latest_version, self.latest_dir, self.latest_dir_version = version, os.path.abspath(path), version

  async def _export(self, params: Any, version: int) -> str:
    """root/v{version}, exported and checked against the reference; latest_dir from then on."""
    try:  # checked before the rename: root/vN (maybe the last good directory) is untouched by a refusal
      path = await asyncio.to_thread(weight_store.export_version, self._export_fn, params, self.root_dir, version,
                                     functools.partial(self._check_export, version))
    except PublishError:
      self._count("refused_shapes")
      raise
    self.latest_dir, self.latest_dir_version = path, version
    return path

  def _check_export(self, version: int, path: str) -> None:
    """Raises PublishError (one line: the field or tensor and both values) for an export that does not fit.

    SGLang accepts such an update with success: true and then serves garbage.
    """
    problem = self.reference.dir_problem(path)
    if problem is not None:
      raise PublishError(f"refusing to publish {protocol.version_to_wire(version)}: {problem} "
                         f"(reference: {self.reference.source}); the export was removed")
    self.reference.adopt_export(path)

  async def resync(self) -> list[str]:
    """Retries the latest version on every out-of-sync server; returns the urls brought back. With a session
    transport, only once a disk export of the latest version exists (else the next publish exports one)."""
    async with self._lock:
      urls = self._needs_sync()
      if self.adapters is not None:
        back = [u for u in urls if await self.adapters.resync(u)]
        self._count("resynced", len(back))
        return back
      if self.latest_dir is None or not urls or self.latest_dir_version != self.latest_version:
        return []
      problem = await asyncio.to_thread(self.reference.dir_problem, self.latest_dir)
      if problem is not None:  # changed on disk since it passed: never send it
        log.error("not re-syncing %s: %s no longer passes the check: %s", urls, self.latest_dir, problem)
        return []
      results = await asyncio.gather(*(self._sync(u, self.latest_version, self.latest_dir, check_model=True)
                                       for u in urls))
    back = [u for u, (ok, _) in zip(urls, results) if ok]
    if back:
      self._count("resynced", len(back))
      log.warning("re-synced %s to %s", back, protocol.version_to_wire(self.latest_version))
    return back

  async def close(self) -> None:
    if self._resync_task is not None:
      self._resync_task.cancel()
      await asyncio.gather(self._resync_task, return_exceptions=True)
      self._resync_task = None
    await self._admin.close()
    if self.adapters is not None:
      await self.adapters.close()
    if self.session is not None:
      await self.session.close()
    await asyncio.to_thread(weight_store.remove_spare, self.root_dir)

  async def check_servers(self) -> None:
    """Refuses to start against servers that serve another model than the reference (the starting weights).

    What each server's /get_model_info reports is compared; its model_path, in full, when readable here.
    """
    if self.reference.spec is None:
      log.warning("no reference weights: the served models are not cross-checked")
      return
    problems = await self.reference.served_problems(self._admin, self.urls)
    if problems:
      raise PublishError(f"refusing to start: servers serve another model than {self.reference.source}: "
                         + "; ".join(problems))

  # -- one server, by disk -------------------------------------------------------------------------
  async def _sync(self, url: str, version: int, path: str, *,
                  check_model: bool = False) -> tuple[bool, Optional[Exception]]:
    wire = protocol.version_to_wire(version)
    error: Optional[Exception] = None
    if check_model and self.reference.spec is not None:  # a server coming back may run another model now
      try:
        problem = await self.reference.served_mismatch(self._admin, url)
      except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
        problem = None
        error = e
      if problem is not None:
        error = admin.Rejected(f"serves another model than {self.reference.source}: {problem}")
      if error is not None:
        self._count("server_failures")
        self.out_of_sync[url] = repr(error)
        log.error("not re-syncing %s to %s: %r", url, wire, error)
        return False, error
    if self.client is not None and self.pause_mode == "abort":
      self.client.set_enabled(url, False)  # resumed requests wait for (or go to) an updated server
    t0 = time.perf_counter()
    try:
      try:
        await disk.update(self._admin, url, wire, path, pause_mode=self.pause_mode,
                          attempts=self.update_attempts, count=self._count)
        await session.confirm(self._admin, url, wire, self._count)
      finally:
        await self._admin.call(url, "POST", "/continue_generation", {})  # never leave a server paused
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RuntimeError) as e:
      error = e
    self.pause_seconds.append(time.perf_counter() - t0)
    if self.client is not None:
      self.client.gauge("publish_last_pause_s", self.pause_seconds[-1])
      if error is None:
        self.client.set_server_version(url, version)
      self.client.set_enabled(url, error is None)
    if error is None:
      self.out_of_sync.pop(url, None)
      return True, None
    self._count("server_failures")
    self.out_of_sync[url] = repr(error)
    log.error("weight update of %s to %s failed: %r; the server is out of rotation until re-synced",
              url, wire, error)
    return False, error

  def _needs_sync(self) -> list[str]:
    """Servers whose update failed, and servers the client's health checks found on other weights."""
    disabled = [u for u in self.urls if self.client is not None and not self.client.is_enabled(u)]
    return list(dict.fromkeys(list(self.out_of_sync) + disabled))

  async def _resync_loop(self) -> None:
    while True:
      await asyncio.sleep(self.resync_interval)
      if self._needs_sync():
        await self.resync()
