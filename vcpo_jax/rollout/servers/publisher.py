"""Weight publisher: export a HF dir per version, install it on every server, confirm, resync the failures.

Default update (`pause_mode="abort"`): take the server out of routing, pause(abort) -> update_weights_from_disk
(flush_cache) -> confirm /get_model_info -> continue. Aborted requests come back with their partial output
and the client resumes them as prompt + partial output, so every token is computed by exactly the weights
its version tag names, and the prefix cache is flushed with each update. `pause_mode="in_place"` keeps
requests running across the update (flush_cache false; the servers need --disable-radix-cache), but the
resumed tokens then attend to KV computed by the old weights: see docs/sglang.md.

With a `wire` sender (rollout.publish=wire) every version after the first goes over the weight group instead
(wire.py): pause and begin on every in-sync server, the buckets, then end, confirm and continue. A server
whose wire update fails, and one found out of sync, is resynced from a disk export of the same version before
it is routed to again; the first load, restarts and resyncs always go by disk.
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
from vcpo_jax.rollout.servers import admin, checkpoint_spec, weight_store
from vcpo_jax.rollout.servers import wire as wire_lib

PAUSE_MODES = ("abort", "in_place")
log = logging.getLogger(__name__)


class PublishError(RuntimeError):
  """The update cannot succeed: every server rejected it (a 4xx), its shapes do not fit the model, or a
  server serves another model than the job's starting weights."""


class _Inconsistent(RuntimeError):
  """A server accepted the update but does not report the version it was given."""


class WeightPublisher:
  """Publishes learner versions to every rollout server; takes failed servers out of rotation until re-synced.

  `client_or_urls` is a RolloutClient (its routing then skips updating and out-of-sync servers, its
  liveness checks keep a restarted server out until it runs the required version, and the publisher's
  counters appear in its stats) or a plain list of server urls. `reference_dir` holds the job's starting
  weights (the directory the servers were launched on): every export and every served model is checked
  against its shapes. Without it, the served model_path if readable here, else the first export.
  """

  def __init__(self, export_fn: weight_store.ExportFn, root_dir: str,
               client_or_urls: Union[client_lib.RolloutClient, Iterable[str]], *, keep_last: int = 3,
               timeout: float = 300.0, resync_interval: float = 5.0, pause_mode: str = "abort",
               update_attempts: int = 3, reference_dir: Optional[str] = None,
               wire: Optional[wire_lib.WireSender] = None):
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
    self.out_of_sync: dict[str, str] = {}  # url -> last error
    self.stats = {"published": 0, "server_failures": 0, "resynced": 0, "version_mismatches": 0,
                  "cache_not_flushed_retries": 0, "refused_shapes": 0, "stale_connection_retries": 0,
                  "wire_versions": 0, "wire_failures": 0, "wire_groups": 0, "disk_resync_exports": 0}
    self.pause_seconds: list[float] = []  # per server and update: pause -> continue
    self._reference: Optional[dict] = None  # the served model's shapes (checkpoint_spec.read_spec)
    self._reference_source = "the first export"
    if reference_dir:
      try:
        self._reference = checkpoint_spec.read_spec(reference_dir)
      except (OSError, ValueError) as e:
        raise ValueError(f"reference_dir={reference_dir!r} is not a readable Hugging Face directory: {e}") from e
      self._reference_source = os.path.abspath(reference_dir)
    weight_store.remove_unchecked_exports(self.root_dir)
    self._lock = asyncio.Lock()
    self._admin = admin.AdminSession(timeout, self._count)
    self._resync_task: Optional[asyncio.Task] = None
    self.wire = wire
    self.latest_dir_version: Optional[int] = None  # the version latest_dir holds (wire versions have none)
    self.wire_seconds: list[float] = []  # per wire version: first pause -> last continue
    self.last_wire_error: Optional[str] = None
    if wire is not None:
      self._wire_admin = admin.AdminSession(wire.timeout_s, self._count)
      if self._reference is not None:
        problem = wire_lib.manifest_mismatch(wire.tensors, self._reference)
        if problem is not None:
          raise PublishError(f"refusing to send weights over the wire: {problem} "
                             f"(reference: {self._reference_source})")

  def _count(self, key: str, n: int = 1) -> None:
    self.stats[key] += n
    if self.client is not None:
      self.client.count(f"publish_{key}", n)

  async def publish(self, params: Any, version: int) -> dict[str, bool]:
    """Exports `version` and installs it on every server concurrently; returns {url: success}."""
    protocol.version_to_wire(version)  # validates
    if self.latest_version is not None and version < self.latest_version:
      raise ValueError(f"version must be >= the last published {self.latest_version}, got {version}")
    async with self._lock:
      if self._reference is None:
        await self._adopt_served_spec()
      if self.wire is not None and self.latest_dir is not None:
        self._require(version)
        by_url = await self._publish_wire(params, version)
        results = [by_url[u] for u in self.urls]
        path = f"the wire ({protocol.version_to_wire(version)})"
      else:
        path = await self._export(params, version)  # a refusal raises here, before any routing state moves
        self._require(version)
        results = await asyncio.gather(*(self._sync(url, version, path) for url in self.urls))
      self.latest_version = version
      await asyncio.to_thread(weight_store.delete_old, self.root_dir, self.keep_last)
    self._count("published")
    if not any(ok for ok, _ in results) and all(isinstance(err, admin.Rejected) for _, err in results):
      raise PublishError(f"every server rejected {path}: " + "; ".join(
          f"{url}: {err}" for url, (_, err) in zip(self.urls, results)))
    if self._resync_task is None:
      self._resync_task = asyncio.create_task(self._resync_loop())
    return {url: ok for url, (ok, _) in zip(self.urls, results)}

  def _require(self, version: int) -> None:
    """From now on a server that comes back (restarted) is routed to only once it serves `version`: called
    when the version is about to be sent, never for one refused before."""
    if self.client is not None:
      self.client.required_version = version

  def adopt(self, version: int, path: str) -> None:
    """The servers were started on `path` as `version` (the embedded servers): no first load is needed, so
    with the wire the next version already goes over it, and a resync sends `path` until a newer export."""
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

  async def _publish_wire(self, params: Any, version: int) -> dict[str, tuple[bool, Optional[Exception]]]:
    """The in-sync servers over the wire; the others, and any the wire fails, from a disk export of `version`."""
    wire = protocol.version_to_wire(version)
    behind = self._needs_sync()
    members = [u for u in self.urls if u not in behind]
    out: dict[str, tuple[bool, Optional[Exception]]] = {}
    if members:
      t0 = time.perf_counter()
      try:
        if self.wire._pg is None or self.wire.members != members:
          self._count("wire_groups")
        await self.wire.ensure_group(self._wire_admin, members)
        await self.wire.prefetch(params)  # the first bucket is packed before any server pauses
        t_pause = time.perf_counter()
        await asyncio.gather(*(self._wire_open(u) for u in members))
        timings = await self.wire.send(self._wire_admin, params, wire, flush_cache=self.pause_mode == "abort")
        await asyncio.gather(*(self._wire_close(u, wire) for u in members))
      except (wire_lib.WireError, aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
        self._count("wire_failures")
        self.last_wire_error = repr(e)
        log.error("wire update to %s failed: %r; resyncing %s from disk", wire, e, members)
        await self.wire.teardown(self._wire_admin)
        await asyncio.gather(*(self._wire_admin.call(u, "POST", "/end_weight_update", {}) for u in members),
                             return_exceptions=True)
        for u in members:
          self.out_of_sync[u] = repr(e)
          if self.client is not None:
            self.client.set_enabled(u, False)
        behind, members = self.urls, []
      else:
        self.wire_seconds.append(time.perf_counter() - t0)
        self.pause_seconds += [time.perf_counter() - t_pause] * len(members)  # paused together: open -> continue
        self._count("wire_versions")
        if self.client is not None:
          self.client.gauge("publish_wire_seconds", self.wire_seconds[-1])
          self.client.gauge("publish_wire_broadcast_seconds", timings["broadcast_s"])
        out.update({u: (True, None) for u in members})
    behind = [u for u in behind if u not in out]
    if behind:
      self._count("disk_resync_exports")
      path = await self._export(params, version)
      results = await asyncio.gather(*(self._sync(u, version, path, check_model=True) for u in behind))
      out.update(zip(behind, results))
      self._count("resynced", sum(ok for ok, _ in results))
    return out

  async def _wire_open(self, url: str) -> None:
    """Out of routing, paused, and an update session open (SGLang refuses a wire update outside one)."""
    if self.client is not None:
      self.client.set_enabled(url, False)
    await self._wire_admin.call(url, "POST", "/pause_generation", {"mode": self.pause_mode})
    await self._wire_admin.call(url, "POST", "/begin_weight_update", {})

  async def _wire_close(self, url: str, wire: str) -> None:
    await self._wire_admin.call(url, "POST", "/end_weight_update", {})
    await self._confirm(url, wire)
    await self._wire_admin.call(url, "POST", "/continue_generation", {})
    self.out_of_sync.pop(url, None)
    if self.client is not None:
      self.client.set_server_version(url, protocol.version_from_wire(wire))
      self.client.set_enabled(url, True)

  async def resync(self) -> list[str]:
    """Retries the latest version on every out-of-sync server; returns the urls brought back. Under the wire,
    only once a disk export of the latest version exists (else the next publish exports one for them)."""
    async with self._lock:
      urls = self._needs_sync()
      if self.latest_dir is None or not urls or self.latest_dir_version != self.latest_version:
        return []
      problem = await asyncio.to_thread(self._dir_problem, self.latest_dir)
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
    if self.wire is not None:
      await self.wire.teardown(self._wire_admin)
      await self._wire_admin.close()

  # -- shapes ------------------------------------------------------------------------------------
  async def check_servers(self) -> None:
    """Refuses to start against servers that serve another model than the reference (the starting weights).

    What each server's /get_model_info reports is compared; its model_path, in full, when readable here.
    """
    if self._reference is None:
      log.warning("no reference weights: the served models are not cross-checked")
      return
    problems = []
    for url in self.urls:
      try:
        problem = await self._served_mismatch(url)
      except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
        log.warning("cannot cross-check the model %s serves: %r", url, e)  # checked again at its resync
        continue
      if problem is not None:
        problems.append(f"{url}: {problem}")
    if problems:
      raise PublishError(f"refusing to start: servers serve another model than {self._reference_source}: "
                         + "; ".join(problems))

  async def _served_mismatch(self, url: str) -> Optional[str]:
    info = await self._admin.call(url, "GET", "/get_model_info")
    if not isinstance(info, dict):
      return f"/get_model_info answered {info!r:.200}"
    problem = checkpoint_spec.info_mismatch(info, self._reference)
    model_path = info.get("model_path")
    if problem is None and isinstance(model_path, str) and os.path.isfile(os.path.join(model_path, "config.json")):
      served = await asyncio.to_thread(checkpoint_spec.read_spec, model_path)
      problem = checkpoint_spec.spec_mismatch(served, self._reference, "the starting weights have")
      if problem is not None:
        problem = f"its model_path {model_path}: {problem}"
    return problem

  def _dir_problem(self, path: str) -> Optional[str]:
    try:
      new = checkpoint_spec.read_spec(path)
    except (OSError, ValueError) as e:
      return f"unreadable: {e}"
    return checkpoint_spec.spec_mismatch(new, self._reference or new)

  def _check_export(self, version: int, path: str) -> None:
    """Raises PublishError (one line: the field or tensor and both values) for an export that does not fit.

    SGLang accepts such an update with success: true and then serves garbage.
    """
    problem = self._dir_problem(path)
    if problem is not None:
      raise PublishError(f"refusing to publish {protocol.version_to_wire(version)}: {problem} "
                         f"(reference: {self._reference_source}); the export was removed")
    if self._reference is None:
      self._reference = checkpoint_spec.read_spec(path)

  async def _adopt_served_spec(self) -> None:
    for url in self.urls:
      try:
        info = await self._admin.call(url, "GET", "/get_model_info")
        model_path = info.get("model_path") if isinstance(info, dict) else None
        if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
          self._reference = await asyncio.to_thread(checkpoint_spec.read_spec, model_path)
          self._reference_source = f"{url}'s model_path {model_path}"
          return
      except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError, ValueError) as e:
        log.warning("cannot read the served model's shapes from %s: %r", url, e)
    log.warning("no reference weights and no server's model_path is readable here: updates are checked "
                "against the first export")

  # -- one server --------------------------------------------------------------------------------
  async def _update(self, url: str, wire: str, path: str) -> None:
    """pause -> update_weights_from_disk, retried while SGLang says the cache could not be flushed.

    That 400 means the weights WERE applied while some request was still queued (e.g. one in transit when
    the pause came); a new pause(abort) clears the queue, and the update is sent again.
    """
    flush = self.pause_mode == "abort"
    for attempt in range(self.update_attempts):
      await self._admin.call(url, "POST", "/pause_generation", {"mode": self.pause_mode})
      try:
        body = await self._admin.call(url, "POST", "/update_weights_from_disk",
                                {"model_path": path, "weight_version": wire, "abort_all_requests": False,
                                 "flush_cache": flush})
      except admin.Rejected as e:
        if protocol.CACHE_NOT_FLUSHED not in str(e) or attempt == self.update_attempts - 1:
          raise
        self._count("cache_not_flushed_retries")
        continue
      if not (isinstance(body, dict) and body.get("success") is True):
        raise admin.Rejected(f"/update_weights_from_disk answered {body!r:.300}")
      return

  async def _confirm(self, url: str, wire: str) -> None:
    info = await self._admin.call(url, "GET", "/get_model_info")
    reported = info.get("weight_version") if isinstance(info, dict) else None
    if reported != wire:
      self._count("version_mismatches")
      raise _Inconsistent(f"reports weight_version={reported!r} after a successful update to {wire}")

  async def _sync(self, url: str, version: int, path: str, *,
                  check_model: bool = False) -> tuple[bool, Optional[Exception]]:
    wire = protocol.version_to_wire(version)
    error: Optional[Exception] = None
    if check_model and self._reference is not None:  # a server coming back may run another model now
      try:
        problem = await self._served_mismatch(url)
      except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
        problem = None
        error = e
      if problem is not None:
        error = admin.Rejected(f"serves another model than {self._reference_source}: {problem}")
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
        await self._update(url, wire, path)
        await self._confirm(url, wire)
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
