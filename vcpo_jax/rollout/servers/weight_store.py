"""Versioned weight directories on disk: exports checked before they are renamed into place, stale ones removed."""
from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import Any, Callable, Optional

from vcpo_jax.model import hf
from vcpo_jax.rollout import protocol

ExportFn = Callable[[Any, str], Any]  # (params, out_dir) -> anything; writes a HF checkpoint directory
_VERSION_DIR = re.compile(r"v([0-9]+)")
_TMP_MARK = ".publish-"  # in the name of an export not yet checked; servers are never sent one


def version_dirs(root_dir: str) -> dict[int, str]:
  """The published version directories under root_dir, by version."""
  out = {}
  for name in os.listdir(root_dir):
    match = _VERSION_DIR.fullmatch(name)
    if match and os.path.isdir(os.path.join(root_dir, name)):
      out[int(match.group(1))] = os.path.join(root_dir, name)
  return out


def export_version(export_fn: ExportFn, params: Any, root_dir: str, version: int,
                   check: Optional[Callable[[str], None]] = None) -> str:
  """Runs export_fn into a private temporary dir, `check`s it, then renames it to root/v{version} (replacing one).

  A failed export or check removes the temporary dir and leaves root/v{version} as it was.
  """
  final = os.path.join(root_dir, protocol.version_to_wire(version))
  tmp = os.path.join(root_dir, f".{os.path.basename(final)}{_TMP_MARK}{uuid.uuid4().hex[:8]}")
  try:
    export_fn(params, tmp)
    if not os.path.isfile(os.path.join(tmp, "config.json")):
      raise RuntimeError(f"export_fn wrote no config.json into {tmp}")
    if check is not None:
      check(tmp)
    hf.replace_directory(tmp, final)  # a re-publish after a resume swaps, never leaves a half directory
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final


def remove_unchecked_exports(root_dir: str) -> None:
  """Exports a crashed publisher left unchecked (never sent to a server)."""
  for name in os.listdir(root_dir):
    if name.startswith(".") and _TMP_MARK in name:
      shutil.rmtree(os.path.join(root_dir, name), ignore_errors=True)


def delete_old(root_dir: str, keep_last: int) -> None:
  """Keeps the newest keep_last version directories."""
  dirs = version_dirs(root_dir)
  for version in sorted(dirs)[:-keep_last]:
    shutil.rmtree(dirs[version], ignore_errors=True)
