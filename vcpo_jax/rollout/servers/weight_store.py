"""Versioned weight directories on disk: exports checked before they are renamed into place, stale ones removed."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import urllib.parse
import uuid
from typing import Any, Callable, Iterable, Optional

from vcpo_jax.model import hf, hf_config, hf_export
from vcpo_jax.rollout import protocol

ExportFn = Callable[[Any, str], Any]  # (params, out_dir) -> anything; writes a HF checkpoint directory
_VERSION_DIR = re.compile(r"v([0-9]+)")
_TMP_MARK = ".publish-"  # in the name of an export not yet checked; servers are never sent one
_SPARE = ".spare.safetensors"  # a RAM-backed root's recycled weights file (delete_old)
RAM_DIR = "/dev/shm"  # RAM-backed: an export there is a memory copy, with no disk write-back to wait for
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
log = logging.getLogger(__name__)


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
  spare = os.path.join(root_dir, _SPARE)
  try:
    if os.path.isfile(spare):  # an old version's file whose memory the export overwrites (hf_export.REUSE_NAME)
      os.makedirs(tmp)
      os.replace(spare, os.path.join(tmp, hf_export.REUSE_NAME))
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
  """Keeps the newest keep_last version directories. Under a RAM-backed root the newest deleted one's weights
  file is kept as the spare the next export overwrites in place: writing into memory already allocated to a
  file takes about a third of the time of allocating it anew (benchmarks/results/results-publish.md). No server is sent
  that version again: the publisher sends only its latest directory."""
  dirs = version_dirs(root_dir)
  old = sorted(dirs)[:-keep_last]
  if old and is_ram_backed(root_dir):
    weights = os.path.join(dirs[old[-1]], hf.WEIGHTS_FILE)
    if os.path.isfile(weights):
      os.replace(weights, os.path.join(root_dir, _SPARE))
  for version in old:
    shutil.rmtree(dirs[version], ignore_errors=True)


def remove_spare(root_dir: str) -> None:
  """The recycled file is memory kept only for the next export: freed when the publisher closes."""
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(root_dir, _SPARE))


def is_ram_backed(path: str) -> bool:
  return os.path.commonpath([os.path.abspath(path), RAM_DIR]) == RAM_DIR


# -- where and in which dtype versions are exported (rollout.publish_dir, rollout.publish_dtype) ----------
PUBLISH_DTYPES = ("auto", "bfloat16", "float32")


def publish_dtype(value: str, reference_dir: Optional[str], param_dtype: str) -> str:
  """The dtype exports are written in. "auto": the dtype the servers serve, i.e. the starting weights'
  config.json torch_dtype (an embedded float32 server keeps float32 log-probs; a bf16 checkpoint gets bf16,
  half the bytes); float16 is exported as float32 (lossless; the server casts). No reference: param_dtype."""
  if value not in PUBLISH_DTYPES:
    raise ValueError(f"invalid config: rollout.publish_dtype={value!r}: must be one of {list(PUBLISH_DTYPES)}")
  if value != "auto":
    return value
  served = param_dtype
  if reference_dir:
    cfg = hf_config.read_config(reference_dir)
    served = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
  return "bfloat16" if served == "bfloat16" else "float32"


def servers_local(urls: Iterable[str]) -> bool:
  """Whether every server runs on this host (no urls: the job's embedded servers)."""
  return {urllib.parse.urlparse(u.strip()).hostname for u in urls} <= _LOOPBACK


def ram_root(workdir: str, version_bytes: int, keep_last: int) -> Optional[str]:
  """RAM_DIR/vcpo-<hash of the workdir> (one per job), when RAM_DIR is a writable directory with room, in it and
  in available memory, for keep_last + 2 versions (the kept ones, the one being written, the recycled file);
  else None."""
  ram_dir = RAM_DIR
  if not (os.path.isdir(ram_dir) and os.access(ram_dir, os.W_OK)):
    return None
  stat = os.statvfs(ram_dir)
  free = min(stat.f_bavail * stat.f_frsize, _available_memory())  # a tmpfs may be sized past the memory
  if free < (keep_last + 2) * version_bytes:
    log.warning("%s has %.1f GB free, less than %d versions of %.2f GB: versions are exported under the "
                "workdir", ram_dir, free / 1e9, keep_last + 2, version_bytes / 1e9)
    return None
  digest = hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12]
  return os.path.join(ram_dir, f"vcpo-{digest}")


def _default_root(workdir: str, servers_are_local: bool, version_bytes: int, keep_last: int) -> str:
  """WORKDIR/weights, or the RAM-backed directory with WORKDIR/weights a link to it (where the versions are
  found as before). A real WORKDIR/weights (a job started before, or on disk) stays where it is."""
  link = os.path.join(workdir, "weights")
  if not servers_are_local or (os.path.isdir(link) and not os.path.islink(link)):
    return link
  ram = ram_root(workdir, version_bytes, keep_last)
  if ram is None:
    return link
  os.makedirs(ram, exist_ok=True)
  os.makedirs(workdir, exist_ok=True)
  if os.path.islink(link) and os.readlink(link) != ram:
    os.remove(link)
  if not os.path.islink(link):
    os.symlink(ram, link)
  return ram


def _available_memory() -> int:
  """MemAvailable of /proc/meminfo in bytes (no limit where it cannot be read)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 2**63


def publish_root(value: str, workdir: str, *, servers_are_local: bool = False, version_bytes: int = 0,
                 keep_last: int = 3) -> str:
  """The directory versions are exported under: rollout.publish_dir when set (made if missing and checked
  writable); when empty, a RAM-backed one (ram_root, linked as WORKDIR/weights) if the servers share this host
  and it has room, else WORKDIR/weights."""
  if not isinstance(value, str):
    raise ValueError(f"invalid config: rollout.publish_dir={value!r}: must be a string (\"\": chosen by the job)")
  if not value:
    return _default_root(workdir, servers_are_local, version_bytes, keep_last)
  root = os.path.abspath(os.path.expanduser(value))
  try:
    os.makedirs(root, exist_ok=True)
    probe = os.path.join(root, f".write-check-{uuid.uuid4().hex[:8]}")
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"invalid config: rollout.publish_dir={value!r}: must be a writable directory ({e})") from e
  return root
