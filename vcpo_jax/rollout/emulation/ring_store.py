"""The lag emulator's past policy versions on disk, so a resumed run samples from the same stale params."""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np


class RingStore:
  """One `v{version}.npz` per saved version under `directory` (leaves by tree path; dtypes numpy lacks, such
  as bfloat16, stored as same-width unsigned ints with the dtype's name beside them). A file is written once,
  atomically (temporary name, then rename)."""

  def __init__(self, directory: str):
    self.directory = directory

  def path(self, version: int) -> str:
    return os.path.join(self.directory, f"v{version}.npz")

  def save(self, version: int, params: Any) -> None:
    if os.path.exists(self.path(version)):
      return  # versions never change once published
    os.makedirs(self.directory, exist_ok=True)
    arrays, dtypes = {}, {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      name, a = jax.tree_util.keystr(key_path), np.asarray(leaf)
      if a.dtype.kind == "V" or a.dtype.type.__module__ == "ml_dtypes":
        dtypes[name], a = a.dtype.name, a.view(f"u{a.dtype.itemsize}")
      arrays[name] = a
    tmp = self.path(version) + ".tmp.npz"
    np.savez(tmp, __dtypes__=np.asarray(json.dumps(dtypes)), **arrays)
    os.replace(tmp, self.path(version))

  def load(self, version: int, like: Any) -> Any:
    """The saved params of `version`, in the tree structure of `like` (the current params)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    with np.load(self.path(version)) as z:
      dtypes = json.loads(str(z["__dtypes__"]))
      out = []
      for key_path, leaf in leaves:
        name = jax.tree_util.keystr(key_path)
        if name not in z.files:
          raise ValueError(f"{self.path(version)} has no parameter {name}: saved by another model")
        a = z[name]
        a = a.view(jnp.dtype(dtypes[name])) if name in dtypes else a  # jnp knows bfloat16 & co.
        if a.shape != np.shape(leaf):
          raise ValueError(f"{self.path(version)}: parameter {name} has shape {a.shape}, the model's is "
                           f"{np.shape(leaf)}")
        out.append(a)
    return jax.tree_util.tree_unflatten(treedef, out)

  def available(self, versions: Iterable[int]) -> list[int]:
    """The newest run of consecutive saved versions among `versions` (the emulator needs them in order)."""
    versions, have = sorted(versions), []
    for v in reversed(versions):
      if not os.path.exists(self.path(v)):
        break
      have.append(v)
    if len(have) < len(versions):
      logging.warning("lag emulation: %d of the checkpoint's %d past versions are missing from %s; the lag "
                      "ramps up again from the oldest one found", len(versions) - len(have), len(versions),
                      self.directory)
    return sorted(have)

  def prune(self, keep: Iterable[int]) -> None:
    """Deletes every saved version not in `keep`."""
    keep = set(keep)
    for f in os.listdir(self.directory) if os.path.isdir(self.directory) else []:
      if f.startswith("v") and f.endswith(".npz") and f[1:-4].isdigit() and int(f[1:-4]) not in keep:
        os.remove(os.path.join(self.directory, f))
