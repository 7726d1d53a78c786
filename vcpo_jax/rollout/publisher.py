"""Weight publisher: export a HF dir per version, then pause -> update_weights_from_disk -> continue on every server."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import uuid
from typing import Any, Callable, Iterable, Optional, Union

import aiohttp

from vcpo_jax import hf
from vcpo_jax.rollout import client as client_lib, protocol

ExportFn = Callable[[Any, str], Any]  # (params, out_dir) -> anything; writes a HF checkpoint directory
_VERSION_DIR = re.compile(r"v([0-9]+)")


class PublishError(RuntimeError):
  """Every server rejected the new weights (a 4xx), so waiting and retrying cannot help."""


def version_dirs(root_dir: str) -> dict[int, str]:
  """The published version directories under root_dir, by version."""
  out = {}
  for name in os.listdir(root_dir):
    match = _VERSION_DIR.fullmatch(name)
    if match and os.path.isdir(os.path.join(root_dir, name)):
      out[int(match.group(1))] = os.path.join(root_dir, name)
  return out


def export_version(export_fn: ExportFn, params: Any, root_dir: str, version: int) -> str:
  """Runs export_fn into a private temporary dir, then renames it to root/v{version} (replacing one)."""
  final = os.path.join(root_dir, client_lib.version_to_wire(version))
  tmp = os.path.join(root_dir, f".{os.path.basename(final)}.publish-{uuid.uuid4().hex[:8]}")
  try:
    export_fn(params, tmp)
    if not os.path.isfile(os.path.join(tmp, "config.json")):
      raise RuntimeError(f"export_fn wrote no config.json into {tmp}")
    hf.replace_directory(tmp, final)  # a re-publish after a resume swaps, never leaves a half directory
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final


class _Rejected(RuntimeError):
  """A server answered the update with a 4xx."""


class WeightPublisher:
  """Publishes learner versions to every rollout server; takes failed servers out of rotation until re-synced.

  `client_or_urls` is a RolloutClient (its routing then skips out-of-sync servers and its health checks
  keep a restarted server out until it runs the required version) or a plain list of server urls.
  """

  def __init__(self, export_fn: ExportFn, root_dir: str,
               client_or_urls: Union[client_lib.RolloutClient, Iterable[str]], *, keep_last: int = 3,
               timeout: float = 300.0, resync_interval: float = 5.0):
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
      raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if not timeout > 0 or not resync_interval > 0:
      raise ValueError(f"timeout and resync_interval must be > 0, got {timeout!r}, {resync_interval!r}")
    self._export, self.root_dir = export_fn, os.path.abspath(root_dir)
    os.makedirs(self.root_dir, exist_ok=True)
    if isinstance(client_or_urls, client_lib.RolloutClient):
      self.client, self.urls = client_or_urls, client_or_urls.urls
    else:
      self.client, self.urls = None, [u.rstrip("/") for u in client_or_urls]
    if not self.urls:
      raise ValueError("client_or_urls must name at least one server")
    self.keep_last, self.timeout, self.resync_interval = keep_last, timeout, resync_interval
    self.latest_version: Optional[int] = None
    self.latest_dir: Optional[str] = None
    self.out_of_sync: dict[str, str] = {}  # url -> last error
    self.stats = {"published": 0, "server_failures": 0, "resynced": 0}
    self._lock = asyncio.Lock()
    self._session: Optional[aiohttp.ClientSession] = None
    self._resync_task: Optional[asyncio.Task] = None

  async def publish(self, params: Any, version: int) -> dict[str, bool]:
    """Exports `version` and installs it on every server concurrently; returns {url: success}."""
    client_lib.version_to_wire(version)  # validates
    if self.latest_version is not None and version < self.latest_version:
      raise ValueError(f"version must be >= the last published {self.latest_version}, got {version}")
    async with self._lock:
      path = await asyncio.to_thread(export_version, self._export, params, self.root_dir, version)
      self.latest_version, self.latest_dir = version, path
      if self.client is not None:
        self.client.required_version = version
      results = await asyncio.gather(*(self._sync(url, version, path) for url in self.urls))
      await asyncio.to_thread(self._delete_old)
    self.stats["published"] += 1
    if not any(ok for ok, _ in results) and all(isinstance(err, _Rejected) for _, err in results):
      raise PublishError(f"every server rejected {path}: " + "; ".join(
          f"{url}: {err}" for url, (_, err) in zip(self.urls, results)))
    if self._resync_task is None:
      self._resync_task = asyncio.create_task(self._resync_loop())
    return {url: ok for url, (ok, _) in zip(self.urls, results)}

  async def resync(self) -> list[str]:
    """Retries the latest version on every out-of-sync server; returns the urls brought back."""
    async with self._lock:
      urls = self._needs_sync()
      if self.latest_dir is None or not urls:
        return []
      results = await asyncio.gather(*(self._sync(u, self.latest_version, self.latest_dir) for u in urls))
    back = [u for u, (ok, _) in zip(urls, results) if ok]
    self.stats["resynced"] += len(back)
    return back

  async def close(self) -> None:
    if self._resync_task is not None:
      self._resync_task.cancel()
      await asyncio.gather(self._resync_task, return_exceptions=True)
      self._resync_task = None
    if self._session is not None:
      await self._session.close()
      self._session = None

  # -- one server --------------------------------------------------------------------------------
  async def _post(self, url: str, path: str, payload: dict) -> Any:
    if self._session is None:
      self._session = aiohttp.ClientSession()
    async with self._session.post(url + path, json=payload,
                                  timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
      body = await resp.json(content_type=None)
      if 400 <= resp.status < 500:
        raise _Rejected(f"{path} answered {resp.status}: {protocol.error_message(body)}")
      if resp.status != 200:
        raise RuntimeError(f"{path} answered {resp.status}: {protocol.error_message(body)}")
      return body

  async def _sync(self, url: str, version: int, path: str) -> tuple[bool, Optional[Exception]]:
    """pause(in_place) -> update_weights_from_disk -> continue; in-flight requests get two version spans."""
    wire = client_lib.version_to_wire(version)
    error: Optional[Exception] = None
    try:
      await self._post(url, "/pause_generation", {"mode": "in_place"})
      try:
        body = await self._post(url, "/update_weights_from_disk",
                                {"model_path": path, "weight_version": wire, "abort_all_requests": False})
        if not (isinstance(body, dict) and body.get("success") is True):
          raise _Rejected(f"/update_weights_from_disk answered {body!r:.300}")
      finally:
        await self._post(url, "/continue_generation", {})  # never leave a server paused
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RuntimeError) as e:
      error = e
    if self.client is not None:
      if error is None:
        self.client.set_server_version(url, version)
      self.client.set_enabled(url, error is None)
    if error is None:
      self.out_of_sync.pop(url, None)
      return True, None
    self.stats["server_failures"] += 1
    self.out_of_sync[url] = repr(error)
    logging.warning("weight publish of %s to %s failed: %r; server out of rotation until re-synced",
                    wire, url, error)
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

  def _delete_old(self) -> None:
    dirs = version_dirs(self.root_dir)
    for version in sorted(dirs)[:-self.keep_last]:
      shutil.rmtree(dirs[version], ignore_errors=True)
