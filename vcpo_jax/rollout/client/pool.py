"""The rollout client's server pool: liveness through /get_model_info, least-outstanding routing, counters."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
from typing import Any, Iterable, Optional

import aiohttp

from vcpo_jax.rollout import protocol


class RolloutError(RuntimeError):
  """A generation that could not be completed on any server."""


@dataclasses.dataclass
class _Server:
  url: str
  healthy: bool = True  # liveness probes and transport errors
  enabled: bool = True  # publisher: weights in sync
  outstanding: int = 0
  picks: int = 0
  failures_in_a_row: int = 0
  version: Optional[int] = None  # last version the publisher installed
  reported_version: Optional[str] = None  # weight_version of the last /get_model_info
  adapters: set = dataclasses.field(default_factory=set)  # LoRA names the server confirmed loading
  in_flight: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # per adapter name

  @property
  def available(self) -> bool:
    return self.healthy and self.enabled


class ServerPool:
  """Servers, their state and the HTTP session; RolloutClient adds generation on top.

  Liveness is `GET /get_model_info`: it answers at once, also while a server is paused for a weight update.
  SGLang's `/health` runs a generation (seconds when busy, 503 after 20 s while paused), so it is not used.
  """

  def __init__(self, urls: Iterable[str], *, request_timeout: float = 600.0, backoff_base: float = 0.05,
               backoff_max: float = 2.0, health_interval: float = 2.0, health_timeout: float = 5.0,
               server_wait_timeout: float = 120.0, max_failures_in_a_row: int = 3,
               max_connections: int = 1024, keepalive_timeout: float = 4.0):
    urls = [u.rstrip("/") for u in urls]
    if not urls or len(set(urls)) != len(urls):
      raise ValueError(f"urls must be a non-empty list of distinct server urls, got {urls!r}")
    for name, value in (("request_timeout", request_timeout), ("backoff_base", backoff_base),
                        ("health_interval", health_interval), ("health_timeout", health_timeout),
                        ("keepalive_timeout", keepalive_timeout)):
      if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    self.request_timeout = request_timeout
    self.backoff_base, self.backoff_max = backoff_base, backoff_max
    self.health_interval, self.health_timeout = health_interval, health_timeout
    self.server_wait_timeout, self.max_failures_in_a_row = server_wait_timeout, max_failures_in_a_row
    # SGLang's web server drops idle keep-alive connections after 5 s; close ours before that.
    self._max_connections, self._keepalive = max_connections, keepalive_timeout
    self.required_version: Optional[int] = None  # set by the publisher; recovered servers must match it
    self.adapter: Optional[str] = None  # set by the adapter publisher: every request names it (LoRA)
    self._servers = {u: _Server(u) for u in urls}
    self._counts = collections.Counter()
    self._bad = collections.Counter()
    self._gauges: dict[str, float] = {}
    self._session: Optional[aiohttp.ClientSession] = None
    self._health_task: Optional[asyncio.Task] = None
    self._changed: Optional[asyncio.Event] = None  # created in start(), inside the running loop

  # -- lifecycle ---------------------------------------------------------------------------------
  async def start(self) -> None:
    if self._session is None:
      connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=self._keepalive)
      self._session = aiohttp.ClientSession(connector=connector)
      self._changed = asyncio.Event()
      self._health_task = asyncio.create_task(self._health_loop())

  async def close(self) -> None:
    if self._health_task is not None:
      self._health_task.cancel()
      await asyncio.gather(self._health_task, return_exceptions=True)
      self._health_task = None
    if self._session is not None:
      await self._session.close()
      self._session = None

  async def __aenter__(self):
    await self.start()
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  # -- pool state --------------------------------------------------------------------------------
  @property
  def urls(self) -> list[str]:
    return list(self._servers)

  @property
  def available_urls(self) -> list[str]:
    return [s.url for s in self._servers.values() if s.available]

  @property
  def stats(self) -> dict:
    out = dict(self._counts)
    out.update(self._gauges)
    out["bad_responses"] = dict(self._bad)
    out["outstanding"] = {u: s.outstanding for u, s in self._servers.items()}
    out["available"] = {u: s.available for u, s in self._servers.items()}
    return out

  def count(self, key: str, n: int = 1) -> None:
    """A counter in `stats` (the job logs them to TensorBoard); the publisher counts its events here too."""
    self._counts[key] += n

  def gauge(self, key: str, value: float) -> None:
    self._gauges[key] = float(value)

  def _server(self, url: str) -> _Server:
    try:
      return self._servers[url.rstrip("/")]
    except KeyError:
      raise ValueError(f"url {url!r} is not in this client's pool {self.urls}") from None

  def set_enabled(self, url: str, enabled: bool) -> None:
    """The publisher takes a server out of rotation while it updates or when out of sync."""
    self._server(url).enabled = enabled
    self._notify()

  def is_enabled(self, url: str) -> bool:
    return self._server(url).enabled

  def set_server_version(self, url: str, version: int) -> None:
    self._server(url).version = version

  def server_adapters(self, url: str) -> set:
    """The LoRA names `url` confirmed loading (the adapter publisher's record; routing reads it)."""
    return self._server(url).adapters

  def adapter_in_flight(self, url: str, name: str) -> int:
    """Requests now on `url` that name the adapter `name`."""
    return self._server(url).in_flight[name]

  def set_adapter(self, name: Optional[str]) -> None:
    """From now on every request names `name`, and only servers that confirmed it are routed to."""
    self.adapter = name
    self._notify()

  def _notify(self) -> None:
    if self._changed is not None:
      self._changed.set()

  def _mark_healthy(self, server: _Server, healthy: bool) -> None:
    if server.healthy != healthy:
      self._counts["marked_up" if healthy else "marked_down"] += 1
      server.healthy = healthy
      server.failures_in_a_row = 0
      self._notify()

  # -- HTTP and liveness -------------------------------------------------------------------------
  async def request_json(self, url: str, method: str, path: str, payload: Any = None,
                         timeout: Optional[float] = None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or raw text). Transport errors propagate."""
    await self.start()
    client_timeout = aiohttp.ClientTimeout(total=timeout or self.request_timeout)
    async with self._session.request(method, url.rstrip("/") + path, json=payload,
                                     timeout=client_timeout) as resp:
      text = await resp.text()
    try:
      return resp.status, json.loads(text) if text else None
    except ValueError:
      return resp.status, text

  async def check_health(self) -> None:
    """Probes every server once: dead ones leave the rotation, recovered ones come back."""
    await asyncio.gather(*(self._probe(s) for s in self._servers.values()))

  async def _probe(self, server: _Server) -> None:
    try:
      status, info = await self.request_json(server.url, "GET", "/get_model_info", timeout=self.health_timeout)
      ok = status == 200 and isinstance(info, dict)
      if ok:
        server.reported_version = info.get("weight_version")
        if not server.healthy and self.adapter is not None:
          server.adapters.clear()  # a restarted server holds no adapter: out until re-synced
          server.enabled = False
        elif not server.healthy and self.required_version is not None and \
            server.reported_version != protocol.version_to_wire(self.required_version):
          server.enabled = False  # a restarted server runs its start-up weights: out until re-synced
    except (aiohttp.ClientError, asyncio.TimeoutError):
      ok = False
    self._mark_healthy(server, ok)

  async def wait_for_servers(self, count: int, timeout_s: float, what: str = "min_servers") -> list[str]:
    """Probes until `count` servers answer (a fleet's servers start alongside the learner, some later than
    others); returns the answering urls, or raises RolloutError naming `what`, the deadline and the rest."""
    await self.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
      await self.check_health()
      up = [s.url for s in self._servers.values() if s.healthy]
      if len(up) >= count:
        return up
      if loop.time() >= deadline:
        down = [u for u in self._servers if u not in up]
        raise RolloutError(f"{len(up)} of {len(self._servers)} rollout servers answered within {timeout_s:g}s, "
                           f"{what} asks for {count}; not answering: {down}")
      await asyncio.sleep(min(self.health_interval, max(0.0, deadline - loop.time())))

  async def _health_loop(self) -> None:
    while True:
      await asyncio.sleep(self.health_interval)
      await self.check_health()

  # -- routing -----------------------------------------------------------------------------------
  async def _pick(self, avoid: set[str]) -> _Server:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + self.server_wait_timeout
    while True:
      candidates = [s for s in self._servers.values()
                    if s.available and (self.adapter is None or self.adapter in s.adapters)]
      preferred = [s for s in candidates if s.url not in avoid] or candidates
      if preferred:
        server = min(preferred, key=lambda s: (s.outstanding, s.picks))
        server.picks += 1
        return server
      remaining = deadline - loop.time()
      if remaining <= 0:
        raise RolloutError(f"no rollout server available for {self.server_wait_timeout}s: {self.stats}")
      self._changed.clear()
      try:
        await asyncio.wait_for(self._changed.wait(), min(remaining, self.health_interval))
      except asyncio.TimeoutError:
        await self.check_health()

  def _backoff(self, attempt: int) -> float:
    return min(self.backoff_max, self.backoff_base * 2.0 ** attempt)
