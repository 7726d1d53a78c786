"""One weight publish at a time in the background: started in version order, its error raised at the next wait."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional


class BackgroundPublish:
  """Runs each publish as a task beside the learner. `start` is called only after `wait` (so versions land
  in order and a refused one raises before the next is exported); `cancel` is for shutdown."""

  def __init__(self):
    self._task: Optional[asyncio.Task] = None
    self.last_seconds: Optional[float] = None  # the latest finished publish's own duration

  @property
  def in_flight(self) -> bool:
    return self._task is not None and not self._task.done()

  def start(self, publish: Callable[[], Awaitable[None]]) -> None:
    if self._task is not None:
      raise RuntimeError("a publish is still pending: wait() for it before starting the next")
    self._task = asyncio.create_task(self._timed(publish))

  async def _timed(self, publish: Callable[[], Awaitable[None]]) -> None:
    t0 = time.perf_counter()
    await publish()
    self.last_seconds = time.perf_counter() - t0

  async def wait(self) -> None:
    """Waits for the pending publish; raises its error (then forgets it: the next start is allowed)."""
    task, self._task = self._task, None
    if task is not None:
      await task

  async def cancel(self) -> None:
    """Stops a pending publish (the publisher's own cleanup runs: a paused server is continued)."""
    task, self._task = self._task, None
    if task is not None:
      task.cancel()
      await asyncio.gather(task, return_exceptions=True)
