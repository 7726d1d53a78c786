"""Memory of the per-sequence gradient paths, compiled on abstract inputs: bounded VCPO vs book-keeping vs GRPO.

Figures, nothing allocated (jax.ShapeDtypeStruct inputs, `lower().compile().memory_analysis()`):
- Qwen2.5-0.5B shape, B=8 x T=1024, remat=full: XLA temporaries per extra token (fit over B=8 and B=4) of the
  bounded VCPO step over GRPO's; book-keeping's beside it. Beside it, per extra token of the live peak (XLA's
  live-range dump) of the whole step (B=4, 8, 16) and of its loss-and-gradient part alone (no optimizer update).
- Qwen2.5-7B shape, rows of T=8192, fsdp over 8 fake CPU devices, one group of 8 rows (one row per device, as
  the job's micro-batch of one group): per-device arguments + outputs + temporaries of each step.

  python -m benchmarks.cpu.bench_bounded --json /tmp/bounded.json            # as `make bench` runs it
  python -m benchmarks.cpu.bench_bounded --part 7b                            # one part (05b, grad, 7b, compile)
"""
from __future__ import annotations

import os

import glob  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Before jax starts: the fsdp mesh's 8 fake devices, and XLA's live-range dump of the 0.5B steps only (module
# jit_live_peak_step, ~11 MB each, removed at exit): it states the step's true peak of live bytes.
DUMP_DIR = tempfile.mkdtemp(prefix="bench_bounded_xla_")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] += (f" --xla_dump_to={DUMP_DIR} --xla_dump_hlo_pass_re=NONE"
                            f" --xla_dump_hlo_module_re=jit_live_peak_step")

import argparse  # noqa: E402
import atexit  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from benchmarks.cpu import bench_compile  # noqa: E402
from benchmarks.common import model_choice  # noqa: E402
from benchmarks.common import records  # noqa: E402

TEMP_GOAL = "<= 1.3"      # bounded VCPO / GRPO temporaries per extra token, same remat (0.5B shape)
DEVICE_GOAL = "<= 80"     # GB per device, bounded VCPO step, 7B shape, T=8192
SHAPE_05B = (8, 1024)
FLAT_MB = 1e-3            # MB per token below which a live peak counts as not growing with the tokens
SHAPE_7B = dict(rows=8, t=8192, devices=8)


def steps(name: str) -> dict:
  """GRPO and the job's VCPO learner along each path (whole batch: no micro-batch scan)."""
  lcs = bench_compile.learner_configs(name)
  vcpo = lcs["vcpo"]
  return {"grpo": lcs["grpo"], "vcpo_book_keeping": dataclasses.replace(vcpo, grad_path="book_keeping"),
          "vcpo_bounded": dataclasses.replace(vcpo, grad_path="bounded")}


atexit.register(shutil.rmtree, DUMP_DIR, ignore_errors=True)


def grad_fn(cfg, lc):
  """The step's loss and gradient along its path (learner.step._loss_and_grads), without the optimizer update:
  its live peak is the gradient computation's own, never the update's parameter-sized phase."""
  import jax
  import jax.numpy as jnp
  from vcpo_jax.learner import step as Lr

  def fn(params, batch):
    with jax.default_matmul_precision(cfg.matmul_precision):
      valid_B = Lr._valid(batch)
      mask_BxT = batch.mask_BxT.astype(jnp.float32) * valid_B[:, None].astype(jnp.float32)
      loss, grads, _, _, sq_B, _ = Lr._loss_and_grads(params, batch, mask_BxT, valid_B, cfg, lc, None,
                                                      lc.generation_budget)
      return loss, grads, sq_B
  return fn


def _compile_with_live_peak(cfg, lc, opt, b: int, t: int, grad_only: bool = False) -> dict:
  """bench_compile.compile_one's step (or grad_fn), plus the peak of live bytes (arguments included) from XLA's
  live-range dump. Why both: temp_size_in_bytes is the size of the packed temporaries allocation, which also
  moves with how XLA's heap simulator happens to pack buffers of different phases; the live peak does not."""
  import jax
  fn = grad_fn(cfg, lc) if grad_only else bench_compile.step_fn(cfg, lc, opt)

  def live_peak_step(state, batch):  # the module name the dump flag selects
    return fn(state, batch)

  shutil.rmtree(DUMP_DIR, ignore_errors=True)  # only this compile's dump is read below
  os.makedirs(DUMP_DIR, exist_ok=True)
  state, batch = bench_compile.abstract_state(cfg, opt), bench_compile.abstract_batch(b, t, group=b)
  c0 = time.process_time()
  jitted = jax.jit(live_peak_step) if grad_only else jax.jit(live_peak_step, donate_argnums=0)
  compiled = jitted.lower(state.params if grad_only else state, batch).compile()
  out = {"cpu_s": round(time.process_time() - c0, 2), "memory": bench_compile.memory_bytes(compiled)}
  for path in glob.glob(os.path.join(DUMP_DIR, "*live_peak_step*live-range.txt")):
    with open(path) as f:
      m = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", f.read())
    if m:
      out["live_peak_bytes"] = int(m.group(1).replace(" ", ""))
  return out


def _slopes(b: int, t: int, runs: dict) -> dict:
  """MB per extra token of the temporaries and of the live peak between B/2 and B, B and 2B, 2B and 4B."""
  temp = {n: r["memory"]["temp_size_in_bytes"] for n, r in runs.items()}
  live = {n: r.get("live_peak_bytes") for n, r in runs.items()}

  def slope(v, lo, hi):
    return (v[hi] - v[lo]) / ((hi - lo) * t) / 1e6 if v.get(lo) and v.get(hi) else None
  out = {"temp_gb": {n: v / 1e9 for n, v in temp.items()},
         "live_peak_gb": {n: v / 1e9 if v else None for n, v in live.items()}}
  for suffix, lo, hi in (("", b // 2, b), ("_2b", b, 2 * b), ("_4b", 2 * b, 4 * b)):
    out[f"per_extra_token_mb{suffix}"] = slope(temp, lo, hi)
    out[f"live_per_extra_token_mb{suffix}"] = slope(live, lo, hi)
  return out


def part_05b(remat: str = "full", grad_only: bool = False) -> list[dict]:
  """Per-extra-token temporaries and live peak of each step at the 0.5B shape, from compiles at B/2, B and 2B
  (grad_only: of the loss-and-gradient part alone, GRPO and bounded VCPO)."""
  from vcpo_jax.job import configuration
  name = "qwen2.5-0.5b"
  b, t = SHAPE_05B
  cfg = dataclasses.replace(model_choice.model_config(name), max_seq_len=t, scan_layers=True, remat=remat)
  opt = configuration.build_optimizer(model_choice.job_config(name))
  rows = []
  for step, lc in steps(name).items():
    if grad_only and step == "vcpo_book_keeping":
      continue
    load = os.getloadavg()[0]
    # B/2..B is the goal's fit. Up to B the whole step's peak is its optimizer update (parameter-sized, the
    # same for every step), so that slope misses the backward's per-token buffers; from 2B to 4B both steps'
    # peaks are in their backward, where per-token buffers dominate (book-keeping's is clear without 4B).
    sizes = (b // 2, b, 2 * b) + ((4 * b,) if step != "vcpo_book_keeping" and not grad_only else ())
    runs = {n: _compile_with_live_peak(cfg, lc, opt, n, t, grad_only) for n in sizes}
    row = {"step": step, "remat": remat, "B": b, "T": t, "part": "grad" if grad_only else "step",
           "cpu_s": runs[b]["cpu_s"], **_slopes(b, t, runs),
           "load_avg_1min": [round(load, 1), round(os.getloadavg()[0], 1)]}
    print(f"[bounded 0.5b{' grad' if grad_only else ''}] {json.dumps(row)}", flush=True)
    rows.append(row)
  return rows


def part_compile() -> list[dict]:
  """Trace+lower and XLA compile seconds of each step at the 0.5B job's defaults (scan, remat none)."""
  from vcpo_jax.job import configuration
  name = "qwen2.5-0.5b"
  b, t = SHAPE_05B
  cfg = dataclasses.replace(model_choice.model_config(name), max_seq_len=t)
  opt = configuration.build_optimizer(model_choice.job_config(name))
  rows = []
  for step, lc in steps(name).items():
    load = os.getloadavg()[0]
    r = bench_compile.compile_one(cfg, lc, opt, b, t)
    row = {"step": step, "remat": cfg.remat, "cpu_s": r["cpu_s"], "lower_s": r["lower_s"],
           "compile_s": r["compile_s"], "load_avg_1min": [round(load, 1), round(os.getloadavg()[0], 1)]}
    print(f"[bounded compile] {json.dumps(row)}", flush=True)
    rows.append(row)
  return rows


def _mesh_compile(cfg, lc, opt, mesh, b: int, t: int) -> dict:
  """Compiles the job's sharded step (train_state.jit_step's shardings) on abstract inputs."""
  import jax
  from flax import linen as nn
  from vcpo_jax.learner import step as Lr, train_state
  from vcpo_jax.parallel import sharding
  state = bench_compile.abstract_state(cfg, opt)
  batch = bench_compile.abstract_batch(b, t, group=b)
  state_sh = train_state.state_shardings(cfg, opt, mesh, sharding.DEFAULT_RULES)
  rows_sh = sharding.batch_sharding(mesh, ndim=1)
  shards = train_state.batch_rows(mesh)

  def fn(state, batch):
    with jax.default_matmul_precision(cfg.matmul_precision):
      return Lr.rl_step(state, batch, model_cfg=cfg, learner_cfg=lc, optimizer=opt, row_shards=shards)

  jitted = jax.jit(fn, in_shardings=(state_sh, rows_sh), out_shardings=(state_sh, sharding.replicated(mesh)),
                   donate_argnums=0)
  c0 = time.process_time()
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(sharding.DEFAULT_RULES)):
    compiled = jitted.lower(state, batch).compile()
  mem = bench_compile.memory_bytes(compiled)
  per_device = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] + mem["temp_size_in_bytes"]
                - mem.get("alias_size_in_bytes", 0))
  return {"cpu_s": round(time.process_time() - c0, 1), "memory": mem, "per_device_gb": per_device / 1e9}


def part_7b(rows: int = SHAPE_7B["rows"], micro: int = 0) -> list[dict]:
  """Per-device memory of the three steps at the 7B shape, T=8192, fsdp=8, one group of 8 rows (or `rows`
  rows in micro-batch chunks of `micro`: the job's scan over groups, with its float32 gradient accumulator)."""
  from vcpo_jax.job import configuration
  from vcpo_jax.parallel import sharding
  from configs import qwen2_5
  from vcpo_jax.model import hf
  job = qwen2_5.get_config("7b")  # the 7B variant's model (bf16 compute) and optimizer
  # remat=full: at 8k tokens every policy that keeps per-layer activations is over a device for GRPO itself.
  cfg = dataclasses.replace(hf.model_config(job.model), max_seq_len=SHAPE_7B["t"], remat="full")
  opt = configuration.build_optimizer(job)
  mesh = sharding.make_mesh(dict(data=1, fsdp=SHAPE_7B["devices"], tensor=1))
  out = []
  for step, lc in steps("qwen2.5-0.5b").items():
    load = os.getloadavg()[0]
    try:
      row = _mesh_compile(cfg, dataclasses.replace(lc, micro_batch_size=micro), opt, mesh, rows, SHAPE_7B["t"])
    except Exception as e:  # noqa: BLE001 - one step failing must not lose the others
      row = {"error": f"{type(e).__name__}: {e}"[:400]}
    row.update(step=step, rows=rows, micro_batch_size=micro, remat=cfg.remat, dtype=cfg.dtype, load_avg_1min=[round(load, 1),
                                                                          round(os.getloadavg()[0], 1)])
    print(f"[bounded 7b] {json.dumps(row)}", flush=True)
    out.append(row)
  return out


# (row field, key suffix, what it is) of the per-extra-token ratios reported for each step over GRPO's.
_SLOPES = (("per_extra_token_mb", "temp_per_token", "XLA temporaries per extra token, fit over B=8,4"),
           ("per_extra_token_mb_2b", "temp_per_token_2b", "XLA temporaries per extra token, fit over B=16,8"),
           ("live_per_extra_token_mb", "live_per_token", "live peak per extra token, B=4..8"),
           ("live_per_extra_token_mb_2b", "live_per_token_2b", "live peak per extra token, B=8..16"),
           ("per_extra_token_mb_4b", "temp_per_token_4b", "XLA temporaries per extra token, fit over B=32,16"),
           ("live_per_extra_token_mb_4b", "live_per_token_4b", "live peak per extra token, B=16..32"))


def _per_token_figures(rows: list[dict], prefix: str) -> list[dict]:
  """Each step's per-extra-token slopes over GRPO's (prefix 'grad_': of the loss-and-gradient part alone)."""
  by = {r["step"]: r for r in rows}
  if not {"grpo", "vcpo_bounded"} <= set(by):
    return []
  g, out, b = by["grpo"], [], SHAPE_05B[0]
  part = "loss and gradient only" if prefix else "whole step"
  for step in ("vcpo_bounded", "vcpo_book_keeping"):
    r = by.get(step)
    if r is None:
      continue
    for field, key, what in _SLOPES:
      if r.get(field) is None:  # book-keeping is not compiled at 4B
        continue
      goal = TEMP_GOAL if (step, field, prefix) == ("vcpo_bounded", "per_extra_token_mb", "") else None
      # A flat GRPO peak (its optimizer update, the same at B=4 and 8) has no per-token slope to divide by.
      both = r.get(field) is not None and g.get(field) is not None
      ok = both and abs(g[field]) >= FLAT_MB
      note = f"{r[field]:.4f} vs GRPO {g[field]:.4f} MB per extra token" if both else ""
      out.append(records.figure(
          f"{prefix}{key}_{step}_over_grpo", f"{step} / GRPO {what} (0.5B, T=1024, remat=full, {part})",
          unit="x", value=r[field] / g[field] if ok else None, goal=goal, details={"rows": rows} if not out else {},
          note=note + ("" if ok or not both else " (GRPO's peak does not grow with the tokens here: no ratio)")))
    gl, rl = g["live_peak_gb"][b], r["live_peak_gb"][b]
    fmt = lambda v: f"{v:.3f}" if v else "-"
    peaks = " / ".join(f"{fmt(v)} vs {fmt(g['live_peak_gb'].get(n))}" for n, v in r["live_peak_gb"].items())
    out.append(records.figure(
        f"{prefix}live_peak_{step}_over_grpo", f"{step} / GRPO live peak (XLA live-range dump), B=8 x T=1024, {part}",
        unit="x", value=rl / gl if gl and rl else None, details={},
        note=f"arguments included; B={' / '.join(str(n) for n in r['live_peak_gb'])}: {peaks} GB"))
  return out


def figures(rows_05b: list[dict], rows_7b: list[dict], rows_compile: list[dict] = ()) -> list[dict]:
  out = []
  for r in rows_compile:
    out.append(records.figure(
        f"compile_{r['step']}_cpu_seconds", f"{r['step']} step trace+compile CPU seconds (0.5B, 24 layers)",
        unit="s", value=r["cpu_s"], goal="<= 12" if r["step"].startswith("vcpo") else None, details=r,
        note=f"B=8 x T=1024, scan, remat={r['remat']}; wall: trace+lower {r['lower_s']} s + XLA {r['compile_s']} s"))
  out += _per_token_figures([r for r in rows_05b if r.get("part", "step") == "step"], "")
  out += _per_token_figures([r for r in rows_05b if r.get("part") == "grad"], "grad_")
  for r in rows_7b:
    out.append(records.figure(
        f"device_memory_7b_{r['step']}",
        f"{r['step']} step per-device memory, 7B shape, {r['rows']} x 8192 over fsdp=8"
        + (f", micro-batches of {r['micro_batch_size']}" if r["micro_batch_size"] else ""),
        unit="GB", value=r.get("per_device_gb"), goal=DEVICE_GOAL if r["step"] == "vcpo_bounded" else None,
        error=r.get("error"), details=r,
        note=f"arguments + outputs + temporaries - aliased, XLA memory_analysis, remat={r['remat']}, {r['dtype']}"))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="accepted for the suite; the figures are compile-only")
  parser.add_argument("--json", default=None)
  parser.add_argument("--part", default="all", choices=("all", "05b", "grad", "7b", "compile"))
  parser.add_argument("--rows-7b", type=int, default=SHAPE_7B["rows"], help="rows of the 7B step (8: one group)")
  parser.add_argument("--micro-7b", type=int, default=0, help="micro-batch rows of the 7B step (0: all at once)")
  args = parser.parse_args(argv)
  import jax
  jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would time nothing
  rows_05b = part_05b() if args.part in ("all", "05b") else []
  rows_05b += part_05b(grad_only=True) if args.part in ("all", "05b", "grad") else []
  rows_7b = part_7b(args.rows_7b, args.micro_7b) if args.part in ("all", "7b") else []
  rows_compile = part_compile() if args.part in ("all", "compile") else []
  return records.emit_figures(figures(rows_05b, rows_7b, rows_compile), args.json)


if __name__ == "__main__":
  main()
