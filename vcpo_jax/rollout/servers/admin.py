"""SGLang's admin endpoints as the publisher calls them: one pooled session, a 4xx as Rejected, one retry of a
pooled connection the server dropped."""
from __future__ import annotations

from typing import Any, Callable, Optional

import aiohttp

from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.client import client as client_lib


class Rejected(RuntimeError):
  """A server answered with a 4xx."""


class AdminSession:
  """JSON calls to servers' admin endpoints; `count(name)` is told of each stale-connection retry."""

  def __init__(self, timeout: float, count: Callable[[str], None]):
    self.timeout, self._count = timeout, count
    self._session: Optional[aiohttp.ClientSession] = None

  async def call(self, url: str, method: str, path: str, payload: Optional[dict] = None) -> Any:
    if self._session is None:
      # Updates come seconds apart and SGLang drops idle keep-alive connections after 5 s: close ours first.
      self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=4.0))
    try:
      return await self._call_once(url, method, path, payload)
    except aiohttp.ClientError as e:
      if not client_lib.stale_connection(e):
        raise
      self._count("stale_connection_retries")  # a dropped pooled connection, not a failed server
      return await self._call_once(url, method, path, payload)

  async def _call_once(self, url: str, method: str, path: str, payload: Optional[dict]) -> Any:
    async with self._session.request(method, url + path, json=payload,
                                     timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
      body = await resp.json(content_type=None)
      if 400 <= resp.status < 500:
        raise Rejected(f"{path} answered {resp.status}: {protocol.error_message(body)}")
      if resp.status != 200:
        raise RuntimeError(f"{path} answered {resp.status}: {protocol.error_message(body)}")
      return body

  async def close(self) -> None:
    if self._session is not None:
      await self._session.close()
      self._session = None
