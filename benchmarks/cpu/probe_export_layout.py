"""Probe: the bf16 export's cast + transposes on CPU at a model shape, against a plain copy of the same bytes.

Every arm makes the same HF-layout bytes from the same float32 params (the numpy arms' checked against XLA's),
timed on its own (min and median of --repeats after one untimed run); `cores` is process CPU time over wall
time (2.0: both cores busy). Arms: memcpy floors (the output's bytes, the input's bytes); XLA: every leaf in
one jit (the export before), one jit per leaf into fresh buffers or into the last result's donated buffers
(the export now), cast only, per-layer transposes; numpy (ml_dtypes): a cast then a transpose per layer
slice, 1 or 2 threads, into preallocated or fresh buffers. A fresh buffer's pages are faulted in as they are
first written: that, not the cast or the transposes, is most of XLA:CPU's time. --exports times the whole
model.safetensors export before and now, interleaved. All arms at 0.5b hold ~14 GB at once (--arms picks some).

  python -m benchmarks.cpu.probe_export_layout --shape=0.5b --repeats=5
  python -m benchmarks.cpu.probe_export_layout --shape=0.5b --repeats=9 --exports=/dev/shm/probe-export
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import time

import numpy as np


def _timed(fn, repeats: int) -> tuple[float, float, float]:
  fn()  # compiles, first touches of the output pages
  walls, cores = [], []
  for _ in range(repeats):
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    walls.append(wall)
    cores.append((time.process_time() - c0) / wall)
  return min(walls), statistics.median(walls), statistics.median(cores)


def compare_exports(cfg, params, one_jit, repeats: int, root: str) -> None:
  """model.safetensors into `root` (RAM-backed: a spare file of the right size overwritten in place, as the
  publisher does), from dispatch to written: the export before (one program, then every tensor written) and
  now (a call per leaf into the last layout's buffers, each leaf written once ready), interleaved so both see
  the same load."""
  import jax
  from vcpo_jax.model import hf_export, safetensors_file
  path, spare = os.path.join(root, "model.safetensors"), os.path.join(root, "spare.safetensors")

  def before():
    layout = hf_export.HfLayout(cfg, "bfloat16", tuple(one_jit(params)), on_device=True)
    safetensors_file.write(hf_export.hf_tensors(layout), path, "bfloat16", reuse=spare)

  last = []

  def now():  # as HttpBackend: the previous version's layout buffers take the new one
    layout = hf_export.hf_layout(params, cfg, "bfloat16", recycle=last.pop() if last else None)
    hf_export.write_layout(layout, path, reuse=spare)
    last.append(layout)

  walls = {"before": [], "now": []}
  for i in range(repeats + 1):
    for name, fn in (("before", before), ("now", now)) if i % 2 else (("now", now), ("before", before)):
      t0 = time.perf_counter()
      fn()
      if i:  # the first round compiles
        walls[name].append(time.perf_counter() - t0)
      os.replace(path, spare)
      jax.block_until_ready(params)
  os.remove(spare)
  size = hf_export.export_bytes(cfg, "bfloat16") / 1e9
  print("| export into a recycled RAM-backed file | min s | median s | s per GB |\n| --- | --- | --- | --- |")
  for name, w in walls.items():
    print(f"| {name} | {min(w):.3f} | {statistics.median(w):.3f} | {statistics.median(w) / size:.3f} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="0.5b")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--arms", default="", help="comma-separated arm names (default: all)")
  parser.add_argument("--exports", default="", help="a RAM-backed directory: time the whole file export "
                      "before and now there (interleaved) instead of the arms")
  args = parser.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import ml_dtypes
  from configs import qwen2_5, tiny
  from vcpo_jax.model import hf, hf_export, transformer

  section = tiny.get_config().model if args.shape == "tiny" else qwen2_5.get_config(args.shape).model
  cfg = hf.model_config(section)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  jax.block_until_ready(params)
  specs = hf_export.leaf_specs(cfg)
  leaves = [hf._get(params, path) for path, _ in specs]
  host = [np.asarray(x) for x in leaves]  # on CPU: the device buffers themselves
  bf16 = np.dtype(ml_dtypes.bfloat16)
  out_shapes = [x.shape[:-2] + (x.shape[-1], x.shape[-2]) if t else x.shape for x, (_, t) in zip(host, specs)]
  outs = [np.empty(s, bf16) for s in out_shapes]
  out_bytes, in_bytes = sum(o.nbytes for o in outs), sum(x.nbytes for x in host)
  src_out, dst_out = np.ones(out_bytes, np.uint8), np.empty(out_bytes, np.uint8)
  src_in, dst_in = np.ones(in_bytes, np.uint8), np.empty(in_bytes, np.uint8)

  def one_program(params):  # the export's layout before it was split per leaf: every leaf in one jitted call
    return [(jnp.swapaxes(hf._get(params, p), -1, -2) if t else hf._get(params, p)).astype(jnp.bfloat16)
            for p, t in specs]
  one_jit = jax.jit(one_program)
  per_leaf = [jax.jit(lambda x, t=t: (jnp.swapaxes(x, -1, -2) if t else x).astype(jnp.bfloat16)) for _, t in specs]
  cast_only = jax.jit(lambda xs: [x.astype(jnp.bfloat16) for x in xs])

  def xla_per_layer(x, t):
    if not t or x.ndim == 2:
      return (jnp.swapaxes(x, -1, -2) if t else x).astype(jnp.bfloat16)
    return jnp.stack([x[i].T.astype(jnp.bfloat16) for i in range(x.shape[0])])
  per_layer = jax.jit(lambda xs: [xla_per_layer(x, t) for x, (_, t) in zip(xs, specs)])

  def units(x):
    """Slices small enough to run on one core in a thread: a layer of a stacked leaf, or the whole leaf."""
    return [slice(i, i + 1) for i in range(x.shape[0])] if x.ndim == 3 else [slice(None)]

  def np_leaf_jobs():
    """(src slice, dst slice, transpose) per layer slice of every leaf: the units the numpy arms work on."""
    jobs = []
    for x, o, (_, t) in zip(host, outs, specs):
      jobs += [(x[u], o[u], t) for u in units(x)]
    return jobs
  jobs = np_leaf_jobs()

  def np_job(job):
    x, o, t = job
    if t:
      o[...] = np.swapaxes(x.astype(bf16), -1, -2)  # cast contiguous, then the transpose moves half the bytes
    else:
      o[...] = x.astype(bf16)

  def np_copyto_job(job):
    x, o, t = job
    np.copyto(o, np.swapaxes(x, -1, -2) if t else x, casting="unsafe")  # one strided, converting pass

  def rne_bf16(x):
    """float32 -> bfloat16 by integer round-to-nearest-even on the bits (NaN kept quiet)."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    r = (u + jnp.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16
    r = jnp.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
    return jax.lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)
  per_leaf_rne = [jax.jit(lambda x, t=t: rne_bf16(jnp.swapaxes(x, -1, -2) if t else x)) for _, t in specs]
  per_leaf_rne_after = [jax.jit(lambda x, t=t: (lambda y: jnp.swapaxes(y, -1, -2) if t else y)(rne_bf16(x)))
                        for _, t in specs]
  per_leaf_copy = [jax.jit(lambda x: jnp.copy(x)) for _ in specs]
  per_leaf_cast = [jax.jit(lambda x: x.astype(jnp.bfloat16)) for _ in specs]
  bf16_leaves = jax.block_until_ready([x.astype(jnp.bfloat16) for x in leaves])
  per_leaf_t16 = [jax.jit(lambda x, t=t: jnp.swapaxes(x, -1, -2) if t else jnp.copy(x)) for _, t in specs]
  casted = [np.empty(x.shape, bf16) for x in host]
  cast_jobs = [(x[u], c[u]) for x, c in zip(host, casted) for u in units(x)]
  t_jobs = [(np.swapaxes(c[u], -1, -2) if t else c[u], o[u]) for c, o, (_, t) in zip(casted, outs, specs)
            for u in units(c)]
  recycled = list(hf_export.hf_layout(params, cfg, "bfloat16").leaves)

  def into_donated():  # the export's own per-leaf calls into the previous result's (donated) buffers
    spare = hf_export.HfLayout(cfg, "bfloat16", tuple(recycled), on_device=True)
    recycled[:] = jax.block_until_ready(hf_export.hf_layout(params, cfg, "bfloat16", recycle=spare).leaves)

  def np_fresh():
    fresh = [np.empty(s, bf16) for s in out_shapes]
    list(pool.map(np_job, [(x[u], f[u], t) for x, f, (_, t) in zip(host, fresh, specs) for u in units(x)]))

  pool = concurrent.futures.ThreadPoolExecutor(2)
  arms = {
      "memcpy, output bytes (1 pass)": lambda: np.copyto(dst_out, src_out),
      "memcpy, input bytes": lambda: np.copyto(dst_in, src_in),
      "xla: every leaf in one jit (a; the export before)": lambda: jax.block_until_ready(one_jit(params)),
      "xla: one jit per leaf, dispatched together (b)": lambda: jax.block_until_ready(
          [f(x) for f, x in zip(per_leaf, leaves)]),
      "xla: cast only, no transposes": lambda: jax.block_until_ready(cast_only(leaves)),
      "xla: per leaf, integer RNE cast then transpose": lambda: jax.block_until_ready(
          [f(x) for f, x in zip(per_leaf_rne_after, leaves)]),
      "xla: per leaf, integer RNE cast of transposed": lambda: jax.block_until_ready(
          [f(x) for f, x in zip(per_leaf_rne, leaves)]),
      "xla: per leaf float32 copy": lambda: jax.block_until_ready([f(x) for f, x in zip(per_leaf_copy, leaves)]),
      "xla: per leaf cast only": lambda: jax.block_until_ready([f(x) for f, x in zip(per_leaf_cast, leaves)]),
      "xla: per leaf bf16 transpose only": lambda: jax.block_until_ready(
          [f(x) for f, x in zip(per_leaf_t16, bf16_leaves)]),
      "numpy: cast only, 2 threads": lambda: list(pool.map(
          lambda j: np.copyto(j[1], j[0], casting="unsafe"), cast_jobs)),
      "numpy: bf16 transpose only, 2 threads": lambda: list(pool.map(lambda j: np.copyto(j[1], j[0]), t_jobs)),
      "xla: one jit per leaf into the last result's donated buffers (the export now)": into_donated,
      "numpy: cast then transpose, 2 threads, fresh outputs": np_fresh,
      "xla: per-layer transposes (c)": lambda: jax.block_until_ready(per_layer(leaves)),
      "numpy: cast then transpose, 1 thread (d)": lambda: [np_job(j) for j in jobs],
      "numpy: cast then transpose, 2 threads (d)": lambda: list(pool.map(np_job, jobs)),
      "numpy: copyto casting, 2 threads": lambda: list(pool.map(np_copyto_job, jobs)),
  }
  load = os.getloadavg()
  if args.exports:
    print(f"shape {args.shape}; {os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"repeats {args.repeats}")
    return compare_exports(cfg, params, one_jit, args.repeats, args.exports)
  want = [a.strip() for a in args.arms.split(",") if a.strip()]
  reference = [np.asarray(y) for y in one_jit(params)]
  load = os.getloadavg()
  print(f"shape {args.shape}: {in_bytes / 1e9:.3f} GB float32 in, {out_bytes / 1e9:.3f} GB bfloat16 out; "
        f"{os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; repeats {args.repeats}")
  print("| arm | min s | median s | s per GB out | cores |\n| --- | --- | --- | --- | --- |")
  for name, fn in arms.items():
    if want and not any(w in name for w in want):
      continue
    best, med, cores = _timed(fn, args.repeats)
    if name.startswith("numpy") and "(d)" in name or "copyto" in name:  # the arms that fill `outs`
      bad = [i for i, (o, r) in enumerate(zip(outs, reference))
             if not np.array_equal(o.view(np.uint16), r.view(np.uint16))]
      if bad:
        raise SystemExit(f"{name}: leaves {bad} differ from the export's bytes")
    print(f"| {name} | {best:.3f} | {med:.3f} | {med / (out_bytes / 1e9):.3f} | {cores:.2f} |", flush=True)
  pool.shutdown()


if __name__ == "__main__":
  main()
