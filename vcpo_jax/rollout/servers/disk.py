"""The disk transport: a version exported as a checked HF directory, and one server's update_weights_from_disk."""
from __future__ import annotations

from typing import Callable

from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.servers import admin as admin_lib


async def update(admin: admin_lib.AdminSession, url: str, wire: str, path: str, *, pause_mode: str,
                 attempts: int, count: Callable[[str], None]) -> None:
  """pause -> update_weights_from_disk, retried while SGLang says the cache could not be flushed.

  That 400 means the weights WERE applied while some request was still queued (e.g. one in transit when
  the pause came); a new pause(abort) clears the queue, and the update is sent again.
  """
  flush = pause_mode == "abort"
  for attempt in range(attempts):
    await admin.call(url, "POST", "/pause_generation", {"mode": pause_mode})
    try:
      body = await admin.call(url, "POST", "/update_weights_from_disk",
                              {"model_path": path, "weight_version": wire, "abort_all_requests": False,
                               "flush_cache": flush})
    except admin_lib.Rejected as e:
      if protocol.CACHE_NOT_FLUSHED not in str(e) or attempt == attempts - 1:
        raise
      count("cache_not_flushed_retries")
      continue
    if not (isinstance(body, dict) and body.get("success") is True):
      raise admin_lib.Rejected(f"/update_weights_from_disk answered {body!r:.300}")
    return
