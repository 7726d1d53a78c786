"""A .safetensors file written from the arrays' own buffers: the header from shapes alone, each tensor at its offset."""
from __future__ import annotations

import json
import os
import struct
from typing import Optional, Union

import numpy as np

DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def header(entries: list[tuple[str, tuple, int]], dtype: str) -> bytes:
  """(name, shape, nbytes) of each tensor, in file order -> 8-byte little-endian length, then the JSON header,
  padded with spaces so the data starts 8-byte aligned."""
  out, offset = {}, 0
  for name, shape, nbytes in entries:
    out[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  out["__metadata__"] = {"format": "pt"}
  blob = json.dumps(out, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  return struct.pack("<Q", len(blob)) + blob


def open_sized(path: str, size: int, reuse: Optional[str]) -> int:
  """A writable file descriptor of `path` sized `size` bytes. A `reuse` file of exactly that size becomes
  `path`: its memory stays allocated and is overwritten in place."""
  if reuse is not None and os.path.isfile(reuse) and os.path.getsize(reuse) == size:
    os.replace(reuse, path)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    os.ftruncate(fd, size)
  except BaseException:
    os.close(fd)
    raise
  return fd


def write_at(fd: int, data: Union[np.ndarray, bytes], offset: int) -> None:
  """An array's raw little-endian bytes (or bytes) at `offset`, unbuffered, without a serialized copy."""
  view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)) if isinstance(data, np.ndarray) \
      else memoryview(data)
  while len(view):  # a write may take fewer bytes than given (Linux: at most ~2 GiB per call)
    done = os.pwrite(fd, view, offset)
    view, offset = view[done:], offset + done


def write(tensors: dict[str, np.ndarray], path: str, dtype: str, reuse: Optional[str] = None) -> None:
  """Every tensor, in the dict's order, one unbuffered write each into a file sized up front."""
  head = header([(name, arr.shape, arr.nbytes) for name, arr in tensors.items()], dtype)
  fd = open_sized(path, len(head) + sum(arr.nbytes for arr in tensors.values()), reuse)
  try:
    write_at(fd, head, 0)
    offset = len(head)
    for arr in tensors.values():
      write_at(fd, arr, offset)
      offset += arr.nbytes
  finally:
    os.close(fd)
