"""LoRA adapters behind the publisher: each version loads under a name never used before, is routed to only once
a server confirms it, and old names are unloaded only when no request in flight names them.

A version is the PEFT adapter (adapter_config.json's dict + {HF tensor name: array}) loaded as `policy-v{N}`
by SGLang's `/load_lora_adapter` (disk: a PEFT directory under the publish root) or
`/load_lora_adapter_from_tensors` (tensor: shared-memory handles and per-tensor sha256 `expected_checksums`
the server checks). Every load and unload has a deadline (the admin session's); a failed one takes that
server out of routing until a resync loads the current adapter again. At most `max_kept` (rl.max_lag + 2)
adapters stay loaded per server: a load first unloads the idle old ones and waits, within its deadline, for
the rest to drain.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Callable, Optional

import numpy as np

from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.servers import admin as admin_lib

log = logging.getLogger(__name__)
TRANSPORTS = ("disk", "tensor")
# A PEFT adapter as sent: (adapter_config.json's dict, {HF tensor name: numpy array}).
PeftFn = Callable[[Any], tuple[dict, dict]]


class AdapterError(RuntimeError):
  """A server did not confirm an adapter load or unload."""


def write_peft_dir(config: dict, tensors: dict, out_dir: str) -> str:
  """A standard PEFT directory (adapter_config.json + adapter_model.safetensors), written to a temporary
  name and renamed, so that a server never reads half of one."""
  from safetensors.numpy import save_file
  tmp = out_dir + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=1)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(tmp, "adapter_model.safetensors"))
  for name in os.listdir(tmp):
    os.chmod(os.path.join(tmp, name), 0o644)  # a real server reads it as its own user
  shutil.rmtree(out_dir, ignore_errors=True)
  os.rename(tmp, out_dir)
  return out_dir


def sha256(array: np.ndarray) -> str:
  """SGLang's expected_checksums entry: sha256 of the tensor's contiguous bytes."""
  return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def check_loaded(body: Any, name: str) -> None:
  """Raises unless a load answer confirms `name` (success, and `name` among loaded_adapters)."""
  if not (isinstance(body, dict) and body.get("success") is True):
    raise AdapterError(f"load of {name} answered {body!r:.300}")
  loaded = body.get("loaded_adapters")
  if isinstance(loaded, dict) and name not in loaded:
    raise AdapterError(f"load of {name} succeeded but loaded_adapters has only {sorted(loaded)}")


class AdapterSync:
  """Loads versions as adapters on the client's servers and keeps the client's routing on confirmed ones.

  `peft_fn(adapter) -> (config dict, {name: array})` turns the learner's adapter into PEFT's form;
  `root_dir` holds the disk transport's directories. The publisher owns `out_of_sync` and calls publish and
  resync under its lock.
  """

  def __init__(self, client, peft_fn: PeftFn, root_dir: str, *, max_kept: int, timeout_s: float,
               transport: str = "disk", out_of_sync: Optional[dict] = None, count=None):
    if transport not in TRANSPORTS:
      raise ValueError(f"the adapter transport (rollout.publish) must be one of {TRANSPORTS}, got {transport!r}")
    if isinstance(max_kept, bool) or not isinstance(max_kept, int) or max_kept < 2:
      raise ValueError(f"max_kept (rl.max_lag + 2) must be an int >= 2, got {max_kept!r}")
    if not timeout_s > 0:
      raise ValueError(f"the adapter load/unload deadline must be > 0 s, got {timeout_s!r}")
    self.client, self.peft_fn, self.root_dir = client, peft_fn, os.path.abspath(root_dir)
    self.max_kept, self.timeout_s, self.transport = max_kept, timeout_s, transport
    self.out_of_sync = {} if out_of_sync is None else out_of_sync
    self._count = count or (lambda key, n=1: None)
    self.admin = admin_lib.AdminSession(timeout_s, lambda key, n=1: self._count(key, n))
    self.current: Optional[str] = None
    self.used: list[str] = []  # every name ever loaded, in order: none is loaded twice with new contents
    self._load: Optional[tuple[str, dict]] = None  # the current adapter's endpoint and body (resyncs)
    self._torch, self._held = None, None
    if transport == "tensor":
      from vcpo_jax.rollout.servers import tensor as tensor_lib
      self._torch = tensor_lib.require_torch()

  def bind(self, out_of_sync: dict, count) -> None:
    """The publisher's out-of-sync record and counters (its stats and the client's) from now on."""
    self.out_of_sync, self._count = out_of_sync, count

  # -- one version -----------------------------------------------------------------------------------
  async def publish(self, adapter: Any, version: int, urls: list[str]) -> dict[str, tuple[bool, Optional[Exception]]]:
    """Loads `version` on every url (concurrently); those that confirm it serve it from now on, the others
    leave routing (out_of_sync). Then unloads the old adapters nothing in flight names."""
    name = protocol.adapter_name(version)
    if name in self.used:
      raise ValueError(f"adapter {name} was loaded before: a version is published once (names are never reused)")
    config, tensors = await asyncio.to_thread(self.peft_fn, adapter)
    self._load = await asyncio.to_thread(self._request, name, config, tensors)
    self.used.append(name)
    results = await asyncio.gather(*(self._load_on(u, name) for u in urls), return_exceptions=True)
    by_url = {}
    for url, result in zip(urls, results):
      if isinstance(result, BaseException):
        self._fail(url, name, result)
        by_url[url] = (False, result if isinstance(result, Exception) else None)
      else:
        by_url[url] = (True, None)
    previous, self.current = self.current, name
    self.client.set_adapter(name)  # from here on a request names it, and goes only where it is confirmed
    for url in urls:
      if not by_url[url][0]:
        self.client.set_enabled(url, False)
    await asyncio.gather(*(self.unload_idle(u) for u in self.client.urls), return_exceptions=True)
    if previous is not None:
      self._drop_files(previous)
    return by_url

  def _request(self, name: str, config: dict, tensors: dict) -> tuple[str, dict]:
    """The load's endpoint and body (disk: the PEFT directory written first)."""
    if self.transport == "disk":
      path = write_peft_dir(config, tensors, os.path.join(self.root_dir, name))
      return "/load_lora_adapter", {"lora_name": name, "lora_path": path}
    self._held = {k: self._torch.from_numpy(np.ascontiguousarray(v)).share_memory_() for k, v in tensors.items()}
    return "/load_lora_adapter_from_tensors", {
        "lora_name": name, "config_dict": config, "expected_checksums": {k: sha256(v) for k, v in tensors.items()}}

  def _body(self, body: dict) -> dict:
    """A load's body; with tensors, handles pickled afresh: each pickled handle is good for one receiver
    (torch's file_system strategy counts one reference per pickle, and the receiver drops it)."""
    if self.transport == "disk":
      return body
    from vcpo_jax.rollout.servers import tensor as tensor_lib
    return dict(body, serialized_named_tensors=tensor_lib.serialize(self._held))

  def _drop_files(self, name: str) -> None:
    """The disk copy of a superseded version (a server that lost it is resynced to the current one)."""
    if self.transport == "disk":
      shutil.rmtree(os.path.join(self.root_dir, name), ignore_errors=True)

  # -- one server ------------------------------------------------------------------------------------
  async def _load_on(self, url: str, name: str) -> None:
    """Room made (at most max_kept loaded), then the load, confirmed; the server records the name."""
    await self._make_room(url)
    endpoint, body = self._load
    try:
      answer = await self.admin.call(url, "POST", endpoint, self._body(body))
    except admin_lib.Rejected as e:
      if "already loaded" not in str(e) or name in self.client.server_adapters(url):
        raise
      # Left on a server given by URL by an earlier run of the job (restarted from a checkpoint before it):
      # other contents under this name. Unloaded first, so the server reads this version's.
      log.warning("adapter %s was already loaded on %s (an earlier run's): unloading it first", name, url)
      await self.admin.call(url, "POST", "/unload_lora_adapter", {"lora_name": name})
      self._count("adapter_unloads")
      answer = await self.admin.call(url, "POST", endpoint, self._body(body))
    check_loaded(answer, name)
    self.client.server_adapters(url).add(name)
    self._count("adapter_loads")

  async def _make_room(self, url: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + self.timeout_s
    while True:
      await self.unload_idle(url)
      if len(self.client.server_adapters(url)) < self.max_kept:
        return
      if loop.time() >= deadline:
        raise AdapterError(f"{len(self.client.server_adapters(url))} adapters still in use after "
                           f"{self.timeout_s:g}s; at most {self.max_kept} (rl.max_lag + 2) are kept")
      await asyncio.sleep(0.05)

  async def unload_idle(self, url: str) -> None:
    """Unloads every adapter of `url` that is not the current one and that no request in flight names."""
    for name in sorted(self.client.server_adapters(url)):
      if name != self.current and self.client.adapter_in_flight(url, name) == 0:
        await self._unload(url, name)

  async def _unload(self, url: str, name: str) -> None:
    adapters = self.client.server_adapters(url)
    adapters.discard(name)  # never routed to again, whatever the answer
    try:
      body = await self.admin.call(url, "POST", "/unload_lora_adapter", {"lora_name": name})
      if not (isinstance(body, dict) and body.get("success") is True):
        raise AdapterError(f"unload of {name} answered {body!r:.300}")
    except Exception as e:
      self._fail(url, name, e)
      raise
    self._count("adapter_unloads")

  def _fail(self, url: str, name: str, error: BaseException) -> None:
    self._count("adapter_failures")
    self.out_of_sync[url] = repr(error)
    self.client.set_enabled(url, False)
    log.error("adapter %s on %s failed: %r; out of routing until resynced", name, url, error)

  async def resync(self, url: str) -> bool:
    """Unloads what `url` may hold that nothing in flight names (a load that timed out may have landed; a
    server marked down and up again has lost our record of it), then loads the current adapter; back in
    routing once it confirms."""
    if self.current is None or self._load is None:
      return False
    recent = self.used[-2 * self.max_kept:]  # older names were unloaded while it was in sync, or never sent
    try:
      for name in sorted(set(self.client.server_adapters(url)) | set(recent)):
        if self.client.adapter_in_flight(url, name) == 0:
          self.client.server_adapters(url).discard(name)
          try:
            await self.admin.call(url, "POST", "/unload_lora_adapter", {"lora_name": name})
          except admin_lib.Rejected:
            pass  # not loaded there: nothing to undo
      await self._load_on(url, self.current)
    except Exception as e:  # noqa: BLE001 -- any failure keeps it out; the next resync tries again
      self._fail(url, self.current, e)
      return False
    self.out_of_sync.pop(url, None)
    self.client.set_enabled(url, True)
    return True

  async def close(self) -> None:
    await self.admin.close()
