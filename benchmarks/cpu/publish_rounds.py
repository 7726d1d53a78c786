"""Timed publishes per arm as the RL loop makes them, against one real SGLang server: learner blocked, whole
publish, export parts, pause."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import shutil
import time
from typing import Any

import aiohttp

from benchmarks.cpu import sglang_server


@dataclasses.dataclass(frozen=True)
class ArmContext:
  """What an arm's publisher is built from: one server, the job's model and tokenizer, its weights root."""
  model_cfg: Any
  tokenizer: Any
  url: str
  root: str
  reference_dir: str
  keep_last: int


class TimedExport:
  """The job's export function (HttpBackend._export: hf_export.write_hf with the job's tokenizer), timed whole
  and in parts (hf_export.write_hf's timings: device_s, host_copy_s, write_s, files_s; the first three overlap:
  each leaf is written while the later ones are still being cast)."""

  def __init__(self, tokenizer):
    self.tokenizer, self.seconds, self.parts = tokenizer, [], []

  def __call__(self, layout, out_dir: str) -> None:
    from vcpo_jax.model import hf_export
    t0, parts = time.perf_counter(), {}
    hf_export.write_hf(layout, out_dir, self.tokenizer, timings=parts)
    self.seconds.append(time.perf_counter() - t0)
    self.parts.append(parts)


def _timed(admin, calls: list, current: list) -> None:
  """Records each admin call of `admin` as (version, endpoint, seconds)."""
  call = admin.call

  async def timed_call(url, method, path, payload=None):
    t0 = time.perf_counter()
    try:
      return await call(url, method, path, payload)
    finally:
      calls.append((current[0], path, time.perf_counter() - t0))

  admin.call = timed_call


UPDATE_CALLS = ("/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_tensor")


async def publish_rounds(make_arm, ctx: ArmContext, params_by_version, probe_ids: list[int], step_s: float,
                         warmup: int = 0) -> dict:
  """Publishes each version as HttpBackend does in the RL loop, a learner step (sleep) after each start; the
  first `warmup` are not reported (compiles, the RAM-backed root's first keep_last files)."""
  from vcpo_jax.model import hf_export
  from vcpo_jax.rollout.servers import background
  pub, dtype, export = make_arm(ctx)
  calls: list[tuple[int, str, float]] = []
  current = [None]
  _timed(pub._admin, calls, current)  # the update call alone, without pause and confirm
  if pub.session is not None:
    _timed(pub.session.admin, calls, current)
  pending, rounds, versions = background.BackgroundPublish(), [], sorted(params_by_version)
  spare = None
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
    before = await sglang_server.prompt_logprobs(session, ctx.url, probe_ids)
    info0 = await sglang_server.get_json(session, ctx.url, "/get_model_info")
    try:
      for version in versions + [None]:
        t0 = time.perf_counter()
        await pending.wait()  # the previous version is live (or its error raised)
        waited = time.perf_counter() - t0
        if rounds:
          rounds[-1].update(publish_s=rounds[-1]["dispatch_s"] + pending.last_seconds)
        if version is None:
          break
        current[0] = version
        t1 = time.perf_counter()
        # as HttpBackend: the last published layout's buffers take the new one
        layout = hf_export.hf_layout(params_by_version[version], ctx.model_cfg, dtype, recycle=spare)
        pending.start(functools.partial(pub.publish, layout, version))
        t2 = time.perf_counter()
        spare = layout  # published once pending.wait() returns
        rounds.append({"version": version, "dtype": dtype, "waited_s": waited, "dispatch_s": t2 - t1,
                       "blocked_s": waited + t2 - t1})
        await asyncio.sleep(step_s)  # the learner step the publish overlaps
    finally:
      await pending.cancel()
      await pub.close()
    rounds = rounds[warmup:]
    for r in rounds:
      mine = [(path, s) for v, path, s in calls if v == r["version"]]
      r["admin_calls"] = [[path.lstrip("/"), round(s, 4)] for path, s in mine]
      r["update_s"] = sum(s for path, s in mine if path in UPDATE_CALLS)
    for r, pause in zip(rounds, pub.pause_seconds[-len(rounds):]):
      r["pause_s"] = pause
    exported = list(zip(export.seconds, export.parts))[-len(rounds):] if export.seconds else []
    for r, (export_s, parts) in zip(rounds, exported):
      r.update(export_s=export_s, **parts)
    info = await sglang_server.get_json(session, ctx.url, "/get_model_info")
    after = await sglang_server.prompt_logprobs(session, ctx.url, probe_ids)
  if info.get("weight_version") != f"v{versions[-1]}":
    raise RuntimeError(f"the server reports {info.get('weight_version')!r} after publishing v{versions[-1]}")
  return {"rounds": rounds, "probe": {"ids": probe_ids, "logprobs_before": before, "logprobs_after": after,
                                      "version_before": info0.get("weight_version"),
                                      "version_after": info.get("weight_version")}}


def measure(args, workdir: str, config, arms_by_name: dict, probe_text: str) -> dict:
  """Starts the server on an exported v0, then publishes args.warmup + args.repeats versions per arm."""
  import jax
  from vcpo_jax.model import hf, hf_export, tokenizer as tokenizer_lib, transformer
  from vcpo_jax.rollout.servers import launcher, weight_store
  model_cfg = hf.model_config(config.model)
  tok = tokenizer_lib.for_model(config.model.get("hf_path", ""))  # the job's: ours without hf_path
  root = os.path.join(workdir, "weights")
  os.makedirs(root, exist_ok=True)
  # Random inits: seed 0 for the v0 the server starts on, then seeds 1 and 2 alternated, so every update
  # changes every tensor and the last version's weights are never v0's.
  v0_dir = weight_store.export_version(
      lambda p, d: hf_export.export(p, model_cfg, d, tok, args.server_dtype),
      transformer.init_params(model_cfg, jax.random.PRNGKey(0)), root, 0)
  inits = [transformer.init_params(model_cfg, jax.random.PRNGKey(seed)) for seed in (1, 2)]
  jax.block_until_ready(inits)
  port = launcher.free_port()
  url, log_path = f"http://127.0.0.1:{port}", os.path.join(workdir, "sglang.log")
  proc = sglang_server.start(v0_dir, port, log_path, python=args.sglang_python, device=args.device,
                             dtype=args.server_dtype)
  # Where the job would export for a server on this host (HttpBackend: an empty rollout.publish_dir).
  publish_root = weight_store.publish_root(  # for a job in workdir/job (workdir/weights holds the server's v0)
      args.publish_dir, os.path.join(workdir, "job"), servers_are_local=True, keep_last=config.rollout.keep_versions,
      version_bytes=max(hf_export.export_bytes(model_cfg, d) for d in ("float32", "bfloat16")))
  arms = {}
  try:
    ready_s = sglang_server.wait_ready(proc, url, log_path, args.server_timeout)
    first, served = 1, None  # served: the init the server holds (None: v0's)
    for name in args.arms:
      ctx = ArmContext(model_cfg, tok, url, os.path.join(publish_root, "arms", name.replace(" ", "_")), v0_dir,
                       config.rollout.keep_versions)
      # Consecutive versions alternate the two inits, the arm's last one differing from what was served
      # before it: its probe shows the served weights changed.
      count = args.warmup + args.repeats
      order = [((served or 0) + count - j) % 2 for j in range(count)]
      out = asyncio.run(publish_rounds(arms_by_name[name], ctx, {first + j: inits[i] for j, i in enumerate(order)},
                                       tok.encode(probe_text), args.step_seconds, args.warmup))
      served = order[-1]
      out["published_bytes"] = hf_export.export_bytes(model_cfg, out["rounds"][0]["dtype"])
      arms[name], first = out, first + count
      if os.path.commonpath([publish_root, workdir]) != workdir:  # RAM: one arm's versions at a time
        shutil.rmtree(ctx.root, ignore_errors=True)
  finally:
    launcher.end_process_tree(proc, grace_s=10.0)
    if os.path.commonpath([publish_root, workdir]) != workdir and not args.publish_dir:  # RAM: not a record
      shutil.rmtree(publish_root, ignore_errors=True)
  shapes = jax.eval_shape(lambda: transformer.init_params(model_cfg, jax.random.PRNGKey(0)))
  count, param_bytes = sum(x.size for x in jax.tree.leaves(shapes)), hf_export.export_bytes(model_cfg, model_cfg.param_dtype)
  return {"arms": arms, "shape": args.shape, "param_count": count, "param_bytes": param_bytes,
          "param_dtype": model_cfg.param_dtype, "server_dtype": args.server_dtype, "server_ready_s": ready_s,
          "server_device": args.device, "step_seconds": args.step_seconds, "root": root if args.workdir else None,
          "publish_root": publish_root, "publish_root_filesystem": _filesystem(publish_root)}


def _filesystem(path: str) -> str:
  """The type of the filesystem holding path (/proc/mounts: the longest mount point above it)."""
  best, kind = "", "unknown"
  with open("/proc/mounts") as f:
    for line in f:
      _, mount, fs = line.split()[:3]
      if os.path.commonpath([os.path.abspath(path), mount]) == mount and len(mount) > len(best):
        best, kind = mount, fs
  return kind
