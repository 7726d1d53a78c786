"""The embedded server's side of the weight wire: SGLang 0.5.23's group and distributed-update endpoints.

As SGLang: `/init_weights_update_group` joins the torch group at rank `rank_offset` (one TP rank);
`/update_weights_from_distributed` answers 400 outside `/begin_weight_update` .. `/end_weight_update`, receives
one broadcast per call (`load_format="flattened_bucket"`: one uint8 buffer, the alignment rule checked) and
loads the tensors at once; `weight_version` is recorded only when the call succeeds. torch is imported only
when a group is asked for: without it the call is a 400 that says how to install it.
"""
from __future__ import annotations

import asyncio
import logging

import jax
import numpy as np
from aiohttp import web

from vcpo_jax.model import hf
from vcpo_jax.rollout import protocol as P
from vcpo_jax.rollout.servers import wire_group, wire_pack

log = logging.getLogger("vcpo_jax.serving.weight_wire")
RECEIVE_TIMEOUT_S = 600.0   # a receive waits this long for the learner's broadcast (SGLang's: torch's 30 min)
_INIT_KEYS = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
_UPDATE_KEYS = ("names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
                "load_format", "selector", "torch_empty_cache")
_OUTSIDE = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"


def _answer(success: bool, message: str) -> web.Response:
  return web.json_response({"success": success, "message": message}, status=200 if success else 400)


async def _body(request: web.Request, keys: tuple[str, ...]) -> dict:
  body = await request.json() if (await request.read()).strip() else {}
  if not isinstance(body, dict):
    raise P.RequestError("request body must be a JSON object.")
  for key in body:
    if key not in keys:
      raise P.unknown_field_error(key, keys)
  return body


async def handle_init_group(request: web.Request) -> web.Response:
  wire = request.app["wire"]
  body = await _body(request, _INIT_KEYS)
  group = body.get("group_name", "weight_update_group")
  try:
    address, port = body["master_address"], int(body["master_port"])
    rank, world = int(body["rank_offset"]), int(body["world_size"])
    backend = body.get("backend", "nccl")
    pg = await asyncio.to_thread(wire_group.join, address, port, rank, world, group, backend, RECEIVE_TIMEOUT_S)
  except Exception as e:  # noqa: BLE001 -- SGLang answers any failure as success: false
    return _answer(False, f"Failed to initialize custom process group: {e}.")
  wire["groups"][group] = (pg, backend)
  return _answer(True, "Succeeded to initialize custom process group.")


async def handle_destroy_group(request: web.Request) -> web.Response:
  wire = request.app["wire"]
  body = await _body(request, ("group_name",))
  entry = wire["groups"].pop(body.get("group_name", "weight_update_group"), None)
  if entry is None:
    return _answer(False, "The group to be destroyed does not exist.")
  await asyncio.to_thread(wire_group.destroy, entry[0])
  return _answer(True, "Succeeded to destroy custom process group.")


async def handle_begin(request: web.Request) -> web.Response:
  await _body(request, ("selector",))
  request.app["wire"]["session"] = True
  return _answer(True, "Weight update session opened.")


async def handle_end(request: web.Request) -> web.Response:
  await _body(request, ())
  request.app["wire"]["session"] = False
  return _answer(True, "Weight update session closed.")


def _receive(entry, names, dtypes, shapes) -> dict[str, np.ndarray]:
  pg, backend = entry
  torch = wire_group.require_torch()
  size = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(jax.numpy.dtype(d)).itemsize
             for d, s in zip(dtypes, shapes))
  wire_pack.unpack(np.zeros(size, np.uint8), names, dtypes, shapes)  # the layout is checked before receiving
  buf = torch.empty(size, dtype=torch.uint8, device="cuda" if backend == "nccl" else "cpu")  # NCCL: GPU memory
  torch.distributed.broadcast(buf, src=0, group=pg)
  return wire_pack.unpack(buf.cpu().numpy(), names, dtypes, shapes)


def _updated_params(engine, received: dict[str, np.ndarray]):
  """The served params with the received HF tensors in place of theirs; the other leaves stay where they are
  on the device (a bucket moves only its own bytes)."""
  cfg = engine.cfg
  params = jax.tree.map(lambda x: x, engine.params)  # new containers, the same arrays
  dtype = np.dtype(cfg.jnp_param_dtype)
  layers: dict = {}
  for layer, (path, name, transpose) in hf.tensors_with_layer(cfg):
    if name not in received:
      continue
    arr = np.asarray(received[name])
    arr = np.ascontiguousarray(arr.T if transpose else arr).astype(dtype, copy=False)
    leaf = hf.get_path(params, path)
    want = tuple(leaf.shape[1:] if layer is not None else leaf.shape)
    if arr.shape != want:
      raise ValueError(f"tensor {name!r} has shape {arr.shape[::-1] if transpose else arr.shape}, expected "
                       f"{want[::-1] if transpose else want}")
    if layer is None:
      hf.set_path(params, path, jax.device_put(arr, leaf.sharding))
    else:
      layers.setdefault(path, []).append((layer, arr))
  for path, items in layers.items():
    leaf = hf.get_path(params, path)
    index = np.array([i for i, _ in items])
    hf.set_path(params, path, leaf.at[index].set(np.stack([a for _, a in items])))
  return params, cfg


async def handle_update(request: web.Request) -> web.Response:
  st, wire = request.app["state"], request.app["wire"]
  body = await _body(request, _UPDATE_KEYS)
  if not wire["session"]:
    return _answer(False, _OUTSIDE)
  group = body.get("group_name", "weight_update_group")
  if group not in wire["groups"]:
    return _answer(False, f"Group {group} not in {list(wire['groups'])}. Please call "
                          "`init_weights_update_group` first.")
  names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
  if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
          and len(names) == len(dtypes) == len(shapes)):
    raise P.RequestError("names, dtypes and shapes must be lists of the same length.")
  if body.get("load_format") != "flattened_bucket":
    raise P.RequestError(f"load_format={body.get('load_format')!r}: this server receives only "
                         "'flattened_bucket' (one broadcast per call).")
  version = body.get("weight_version")
  try:
    received = await asyncio.to_thread(_receive, wire["groups"][group], names, dtypes, shapes)
    await st.engine.update_weights(lambda: _updated_params(st.engine, received), version,
                                   abort_all=bool(body.get("abort_all_requests", False)))
  except Exception as e:  # noqa: BLE001 -- as SGLang: the update failed, the server goes on
    log.error("update_weights_from_distributed failed: %r", e)
    return _answer(False, f"Failed to receive weights: {e}")
  if version is not None:
    st.reported_version = version
  return _answer(True, "Succeeded to update parameter online.")


def add_routes(app: web.Application) -> None:
  app["wire"] = {"groups": {}, "session": False}
  app.router.add_post("/init_weights_update_group", handle_init_group)
  app.router.add_post("/destroy_weights_update_group", handle_destroy_group)
  app.router.add_post("/begin_weight_update", handle_begin)
  app.router.add_post("/end_weight_update", handle_end)
  app.router.add_post("/update_weights_from_distributed", handle_update)
