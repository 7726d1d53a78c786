"""The embedded server's /update_weights_from_tensor (SGLang 0.5.23's request): handles to the learner's buffers.

As SGLang: a 400 outside /begin_weight_update .. /end_weight_update; `serialized_named_tensors` holds one base64
ForkingPickler dump per TP rank (one here) of [(HF name, tensor)], unpickled with only torch's tensor and
storage rebuilders allowed (a handle names shared memory or a CUDA IPC buffer; nothing else is executed);
the tensors are loaded at once and `weight_version` is recorded only when the call succeeds. The session's
pause keeps a half-received version from being served. torch is imported only when the endpoint is called.
"""
from __future__ import annotations

import asyncio
import base64
import io
import logging
import pickle

import jax
import numpy as np
from aiohttp import web

from vcpo_jax.rollout import protocol as P
from vcpo_jax.serving import weight_wire

log = logging.getLogger("vcpo_jax.serving.weight_tensor")
_KEYS = ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
         "selector", "torch_empty_cache")
_OUTSIDE = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
_DTYPES = ("bfloat16", "float16", "float32")
_ALLOWED = {("torch.multiprocessing.reductions", n) for n in ("rebuild_tensor", "rebuild_typed_storage",
                                                               "rebuild_storage_filename", "rebuild_cuda_tensor")}
_ALLOWED |= {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage")}
_ALLOWED |= {("torch", d) for d in _DTYPES}


class _HandlesOnly(pickle.Unpickler):
  def find_class(self, module, name):
    if (module, name) not in _ALLOWED:
      raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: only tensor handles are accepted")
    return super().find_class(module, name)


def _load(payload: str) -> dict[str, np.ndarray]:
  """[(name, tensor)] from one rank's payload, as host arrays in the tensors' dtype (copies: the learner's
  buffers are released once the call returns)."""
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"update_weights_from_tensor needs torch on the server: pip install torch ({e})") from e
  named = _HandlesOnly(io.BytesIO(base64.b64decode(payload, validate=True))).load()
  if not (isinstance(named, list) and all(isinstance(x, tuple) and len(x) == 2 for x in named)):
    raise ValueError("the payload must be a list of (name, tensor) pairs")
  out = {}
  for name, t in named:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
      raise ValueError(f"tensor {name}: dtype {dtype!r} is not one of {_DTYPES}")
    host = t.detach().cpu().contiguous()
    bits = host.view(torch.int16) if dtype == "bfloat16" else host
    arr = bits.numpy().copy()
    out[name] = arr.view(np.dtype(jax.numpy.dtype(dtype))) if dtype == "bfloat16" else arr
  return out


async def handle_update(request: web.Request) -> web.Response:
  st, wire = request.app["state"], request.app["wire"]
  body = await weight_wire._body(request, _KEYS)
  if not wire["session"]:
    return weight_wire._answer(False, _OUTSIDE)
  payloads = body.get("serialized_named_tensors")
  if not (isinstance(payloads, list) and payloads and all(isinstance(p, str) for p in payloads)):
    raise P.RequestError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank).")
  if body.get("load_format") is not None:
    raise P.RequestError(f"load_format={body.get('load_format')!r}: this server loads only named tensors "
                         "(load_format null).")
  version = body.get("weight_version")
  try:
    received = await asyncio.to_thread(_load, payloads[0])
    await st.engine.update_weights(lambda: weight_wire._updated_params(st.engine, received), version,
                                   abort_all=bool(body.get("abort_all_requests", False)))
  except Exception as e:  # noqa: BLE001 -- as SGLang: the update failed, the server goes on
    log.error("update_weights_from_tensor failed: %r", e)
    return weight_wire._answer(False, f"Failed to update weights from tensor: {e}")
  if version is not None:
    st.reported_version = version
  return weight_wire._answer(True, "Succeeded to update parameter online.")


def add_routes(app: web.Application) -> None:
  app.router.add_post("/update_weights_from_tensor", handle_update)
