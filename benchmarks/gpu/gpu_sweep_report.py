"""The GPU sweep's figures (per lever: step time, MFU against the peak and the real-shape ceiling, memory, top ops)
and its section of results-gpu.md."""
from __future__ import annotations

from benchmarks.gpu import gpu_sweep_levers as levers_lib
from benchmarks.common import records
from benchmarks.common import summary

MFU_GOAL = ">= 0.45"
CEILING_GOAL = ">= 0.7"
RATIO_GOAL = "<= 1.1"


def best_lever(results: dict) -> str | None:
  """The fastest GRPO combination that computes the model's numbers as the baseline does (no precision lever)."""
  timed = {k: summary.summarize(r["seconds"]).median for k, r in results.items()
           if "@" not in k and k not in levers_lib.NOT_COMBINED}
  return min(timed, key=timed.get) if timed else None


def ceiling_for(ceiling: dict | None, tokens: int) -> tuple[float | None, int | None]:
  """The ceiling measured at the largest token count <= tokens (else the smallest measured)."""
  measured = {int(t): c["flop_per_s"] for t, c in ((ceiling or {}).get("ceilings") or {}).items() if c["flop_per_s"]}
  if not measured:
    return None, None
  at = max((t for t in measured if t <= tokens), default=min(measured))
  return measured[at], at


def lever_details(r: dict, ceiling: dict | None, reason: str) -> dict:
  """What a lever's row shows, from its child's result."""
  median = summary.summarize(r["seconds"]).median
  peak = (ceiling or {}).get("peak")
  ceil, at = ceiling_for(ceiling, r["micro_tokens"])
  est = r["xla_memory"].get("peak_estimate_bytes")
  device_peak = r.get("device_memory_after", {}).get("peak_bytes_in_use")
  return {"reason": reason, "overrides": r["overrides"], "median_s": median,
          "mfu_peak": r["analytic_flops"] / median / peak if peak else None,
          "mfu_ceiling": r["analytic_flops"] / median / ceil if ceil else None, "ceiling_tokens": at,
          "micro_tokens": r["micro_tokens"], "xla_peak_gb": est / 1e9 if est else None,
          "device_peak_gb": device_peak / 1e9 if device_peak else None, "remat": r["remat"],
          "compile_s": r["compile_s"], "top_ops": r.get("top_ops", []), "backend": r["backend"]}


def figures(ceiling: dict | None, results: dict, errors: dict, combined, vcpo_at: str | None = None) -> list[dict]:
  """Every figure of the sweep; the VCPO ratios are those run at lever `vcpo_at` (default: the best)."""
  figs = []
  if ceiling:
    figs.append(records.figure("sweep_matmul_peak", "bf16 matmul peak (square sizes, same run)", unit="TFLOP/s",
                               value=ceiling["peak"] / 1e12, details=ceiling["peak_details"]))
    for tokens, c in ceiling["ceilings"].items():
      figs.append(records.figure(
          f"sweep_gemm_ceiling_{tokens}", f"GEMM ceiling at the model's shapes, {tokens} tokens per micro-batch",
          unit="TFLOP/s", value=None if c["flop_per_s"] is None else c["flop_per_s"] / 1e12, details=c,
          note="the step's GEMMs (forward, dX, dW) each timed by its kernels, weighted by its count per step"))
  elif "ceiling" in errors:
    figs.append(records.failed_figure("sweep_matmul_peak", "bf16 matmul peak and GEMM ceiling", errors["ceiling"]))
  reasons = {lever.name: lever.reason for lever in levers_lib.LEVERS}
  if combined is not None:
    reasons[combined.name] = combined.reason
  for name, reason in reasons.items():
    if name in errors:
      figs.append(records.failed_figure(f"sweep_step_{name}", f"GRPO step, lever {name}", errors[name],
                                        details={"reason": reason}))
    elif name in results:
      r = results[name]
      d = lever_details(r, ceiling, reason)
      figs.append(records.figure(
          f"sweep_step_{name}", f"GRPO step, lever {name} (B={r['rows']}, T={r['seq_len']})", unit="s",
          stats=summary.summarize(r["seconds"]), details=d,
          note=f"MFU {_pct(d['mfu_peak'])} of the peak, {_pct(d['mfu_ceiling'])} of the ceiling; remat {d['remat']}"))
  best = best_lever(results)
  if best is None:
    return figs
  d = lever_details(results[best], ceiling, reasons.get(best, ""))
  mfu = [results[best]["analytic_flops"] / t / ceiling["peak"] for t in results[best]["seconds"]] if ceiling else []
  if mfu:
    figs.append(records.figure("sweep_best_mfu", f"GRPO step MFU at the best lever ({best}), of the same-run peak",
                               unit="%", goal=MFU_GOAL, stats=summary.summarize(mfu), details={"lever": best}))
  if d["mfu_ceiling"] is not None:
    figs.append(records.figure("sweep_best_ceiling_fraction", f"GRPO step at the best lever ({best}), of the "
                               f"GEMM ceiling at {d['ceiling_tokens']} tokens", unit="%", goal=CEILING_GOAL,
                               value=d["mfu_ceiling"], details={"lever": best}))
  at = vcpo_at or best
  for learner in ("vcpo_bounded", "vcpo_book_keeping"):
    key = f"{learner}@{at}"
    if key in errors:
      figs.append(records.failed_figure(f"sweep_{learner}_over_grpo", f"{learner} / GRPO at {at}", errors[key],
                                        goal=RATIO_GOAL))
    elif key in results and at in results:
      ratio = summary.ratio_samples(results[key]["seconds"], results[at]["seconds"])
      est = results[key]["xla_memory"].get("peak_estimate_bytes")
      figs.append(records.figure(
          f"sweep_{learner}_over_grpo", f"{learner.replace('_', ' ')} / GRPO step time at lever {at}",
          unit="x", goal=RATIO_GOAL, stats=summary.summarize(ratio),
          details={"seconds": results[key]["seconds"], "xla_peak_gb": est / 1e9 if est else None,
                   "remat": results[key]["remat"]}))
  return figs


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:.1f}%"


def _num(x, spec=".3g") -> str:
  return "-" if x is None else format(x, spec)


def section(figures: list[dict]) -> str:
  """## Sweep: the levers' table, the GEMM ceilings, the top ops of the baseline and the best."""
  by_key = {f["key"]: f for f in figures}
  steps = [f for f in figures if f["key"].startswith("sweep_step_")]
  if not steps and "sweep_matmul_peak" not in by_key:
    return ""
  lines = ["## Sweep (levers of the GRPO step)", "",
           "| lever | step (s) | MFU of peak | of ceiling | XLA peak GB | device peak GB | remat | compile (s) | "
           "why it is here |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for f in steps:
    d, name = f["details"], f["key"].removeprefix("sweep_step_")
    if f["error"]:
      lines.append(f"| {name} | {f['error'][:120]} | | | | | | | {d.get('reason', '')} |")
      continue
    lines.append(f"| {name} | {_num(d['median_s'])} | {_pct(d['mfu_peak'])} | {_pct(d['mfu_ceiling'])} | "
                 f"{_num(d['xla_peak_gb'])} | {_num(d['device_peak_gb'])} | {d['remat']} | "
                 f"{d['compile_s']:.0f} | {d['reason']} |")
  for key in ("sweep_best_mfu", "sweep_best_ceiling_fraction", "sweep_vcpo_bounded_over_grpo",
              "sweep_vcpo_book_keeping_over_grpo"):
    if key in by_key:
      f = by_key[key]
      shown = f["error"] or (_pct(f["value"]) if f["unit"] == "%" else f"{_num(f['value'])}{f['unit']}")
      lines.append(f"\n- {f['title']}: {shown} (goal {f['goal']}: {'met' if f['goal_met'] else 'NOT met'})")
  ceilings = [f for f in figures if f["key"].startswith("sweep_gemm_ceiling_") and not f["error"]]
  if ceilings:
    lines += ["", "| GEMM ceiling | TFLOP/s |", "| --- | --- |"]
    lines += [f"| {f['title']} | {_num(f['value'])} |" for f in ceilings]
    if "sweep_matmul_peak" in by_key:
      lines.append(f"| bf16 matmul peak (square) | {_num(by_key['sweep_matmul_peak']['value'])} |")
  best = by_key.get("sweep_best_mfu", {}).get("details", {}).get("lever")
  for name in dict.fromkeys(["baseline", best]):
    f = by_key.get(f"sweep_step_{name}")
    if f and not f["error"] and f["details"].get("top_ops"):
      lines += ["", f"Top ops of one profiled step, lever {name}:", "", "| op | ms | share | what |",
                "| --- | --- | --- | --- |"]
      lines += [f"| {o['op']} | {o['ms_per_step']:.2f} | {_pct(o['share'])} | `{o['what']}` |"
                for o in f["details"]["top_ops"]]
  return "\n".join(lines)
