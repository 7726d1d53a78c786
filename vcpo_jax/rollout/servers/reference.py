"""The shapes every export and every served model are checked against: the job's starting weights, else a
server's readable model_path, else the first export."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Iterable, Optional

import aiohttp

from vcpo_jax.rollout.servers import admin as admin_lib, checkpoint_spec

log = logging.getLogger(__name__)


class Reference:
  """The reference spec (checkpoint_spec.read_spec) and where it came from, for messages."""

  def __init__(self, reference_dir: Optional[str]):
    self.spec: Optional[dict] = None
    self.source = "the first export"
    if reference_dir:
      try:
        self.spec = checkpoint_spec.read_spec(reference_dir)
      except (OSError, ValueError) as e:
        raise ValueError(f"reference_dir={reference_dir!r} is not a readable Hugging Face directory: {e}") from e
      self.source = os.path.abspath(reference_dir)

  def dir_problem(self, path: str) -> Optional[str]:
    """The first difference between the directory's shapes and the reference's (or its own, without one)."""
    try:
      new = checkpoint_spec.read_spec(path)
    except (OSError, ValueError) as e:
      return f"unreadable: {e}"
    return checkpoint_spec.spec_mismatch(new, self.spec or new)

  def adopt_export(self, path: str) -> None:
    """Without a reference, the first export that passed becomes it."""
    if self.spec is None:
      self.spec = checkpoint_spec.read_spec(path)

  async def served_mismatch(self, admin: admin_lib.AdminSession, url: str) -> Optional[str]:
    """What the server's /get_model_info reports, and its model_path in full when readable here, against the
    reference; None when they match."""
    info = await admin.call(url, "GET", "/get_model_info")
    if not isinstance(info, dict):
      return f"/get_model_info answered {info!r:.200}"
    problem = checkpoint_spec.info_mismatch(info, self.spec)
    model_path = info.get("model_path")
    if problem is None and isinstance(model_path, str) and os.path.isfile(os.path.join(model_path, "config.json")):
      served = await asyncio.to_thread(checkpoint_spec.read_spec, model_path)
      problem = checkpoint_spec.spec_mismatch(served, self.spec, "the starting weights have")
      if problem is not None:
        problem = f"its model_path {model_path}: {problem}"
    return problem

  async def served_problems(self, admin: admin_lib.AdminSession, urls: Iterable[str]) -> list[str]:
    """"URL: problem" for each server whose served model is not the reference's (served_mismatch); one that
    cannot answer is logged and passed over (a publish checks it again at its resync)."""
    problems = []
    for url in urls:
      try:
        problem = await self.served_mismatch(admin, url)
      except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
        log.warning("cannot cross-check the model %s serves: %r", url, e)
        continue
      if problem is not None:
        problems.append(f"{url}: {problem}")
    return problems

  async def adopt_served(self, admin: admin_lib.AdminSession, urls: Iterable[str]) -> None:
    """Without a reference: the first server's model_path readable here."""
    for url in urls:
      try:
        info = await admin.call(url, "GET", "/get_model_info")
        model_path = info.get("model_path") if isinstance(info, dict) else None
        if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
          self.spec = await asyncio.to_thread(checkpoint_spec.read_spec, model_path)
          self.source = f"{url}'s model_path {model_path}"
          return
      except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError, ValueError) as e:
        log.warning("cannot read the served model's shapes from %s: %r", url, e)
    log.warning("no reference weights and no server's model_path is readable here: updates are checked "
                "against the first export")
