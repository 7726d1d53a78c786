"""Top XLA ops by time from a jax.profiler trace (its .xplane.pb, read by jax.profiler.ProfileData), named by the
compiled program's HLO (op kind, custom-call target, result shape)."""
from __future__ import annotations

import collections
import glob
import os
import re

from benchmarks.aot import hlo


def trace_steps(step, steps: int, log_dir: str) -> str:
  """Runs `step()` `steps` times under jax.profiler.trace into log_dir; returns the .xplane.pb written."""
  import jax
  with jax.profiler.trace(log_dir):
    for _ in range(steps):
      jax.block_until_ready(step())
  found = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  if not found:
    raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {log_dir}")
  return found[-1]


def op_times(xplane_path: str, key: str = "hlo_op") -> dict[str, float]:
  """{HLO op name (or, key="hlo_module", module name): total ns} over the events that carry an 'hlo_op' stat:
  the device planes' (GPU kernels) where there are any, else the host's (the CPU runtime's thunks)."""
  import jax
  data = jax.profiler.ProfileData.from_file(xplane_path)
  per_plane = {}
  for plane in data.planes:
    totals = collections.Counter()
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" in stats:
          totals[str(stats.get(key, "?"))] += float(event.duration_ns)
    if totals:
      per_plane[plane.name] = totals
  device = [name for name in per_plane if name.startswith("/device:")]
  chosen = device or list(per_plane)
  out = collections.Counter()
  for name in chosen:
    out.update(per_plane[name])
  return dict(out)


def module_times(xplane_path: str) -> dict[str, float]:
  """{HLO module name ("jit_<function>"): total ns of its ops}."""
  return op_times(xplane_path, key="hlo_module")


def describe_ops(hlo_text: str) -> dict[str, str]:
  """{instruction name: "op kind [custom-call target] result type"} of a compiled module's text."""
  out = {}
  for _, name, type_str, op, rest in hlo.instructions(hlo_text):
    target = re.search(r'custom_call_target="([^"]+)"', rest) if op == "custom-call" else None
    kind = re.search(r"kind=(k\w+)", rest) if op == "fusion" else None
    label = op + (f" {target.group(1)}" if target else "") + (f" {kind.group(1)}" if kind else "")
    out[name] = f"{label} -> {type_str[:80]}"
  return out


def top_ops(xplane_path: str, hlo_text: str, steps: int, top: int = 12) -> list[dict]:
  """The `top` ops by time per step: name, ms per step, share of all op time, what the HLO says it is."""
  times = op_times(xplane_path)
  total = sum(times.values()) or 1.0
  names = describe_ops(hlo_text)
  ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
  return [{"op": name, "ms_per_step": ns / steps / 1e6, "share": ns / total, "what": names.get(name, "?")}
          for name, ns in ranked]
