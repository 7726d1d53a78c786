"""The compile benchmark's report: its headline figures and the markdown table of every compiled variant."""
from __future__ import annotations

from benchmarks.common import records

COMPILE_GOAL = "<= 10"             # seconds, VCPO step at 24 layers (benchmarks/common/goals.py)
TEMP_GOAL = "<= 0.1"               # MB of XLA temporaries per token at the 0.5B shape


def figures(result: dict) -> list[dict]:
  """Headline figures: compile seconds and temporaries per token of the headline VCPO step (first VCPO row)
  at the model's depth, the GRPO step's beside it; every row in the details."""
  depth = result["model_config"]["num_layers"]
  at_depth = [r for r in result["rows"] if r["layers"] == depth]
  shape = f"B={result['rows'][0]['B']}, T={result['rows'][0]['T']}, {depth} layers" if result["rows"] else ""
  details = {k: result[k] for k in ("commit", "model", "knobs_present", "backend")}
  details["rows"] = result["rows"]
  out = []
  for step, title in (("vcpo", "VCPO"), ("grpo", "GRPO")):
    row = next((r for r in at_depth if r["step"] == step), {})
    key = f"compile_{step}"
    if not row or row.get("error"):
      err = row.get("error", "not measured")
      out += [records.failed_figure(f"{key}_seconds", f"{title} step trace+compile CPU seconds (abstract inputs)",
                                    err, goal=COMPILE_GOAL if step == "vcpo" else None),
              records.failed_figure(f"{key}_temp_mb_per_token", f"{title} step XLA temporaries, MB per token",
                                    err, goal=TEMP_GOAL if step == "vcpo" else None)]
      continue
    note = (f"{shape}, {row['variant']}; process CPU seconds (wall {row['total_s']} s: trace+lower "
            f"{row['lower_s']} + XLA compile {row['compile_s']}, load avg {row.get('load_avg_1min', '-')})")
    out += [records.figure(f"{key}_seconds", f"{title} step trace+compile CPU seconds (abstract inputs)",
                           value=row.get("cpu_s", row["total_s"]), unit="s", goal=COMPILE_GOAL if step == "vcpo" else None,
                           note=note, details=details if step == "vcpo" else {}),
            records.figure(f"{key}_temp_mb_per_token", f"{title} step XLA temporaries, MB per token",
                           value=row["temp_mb_per_token"], unit="MB", goal=TEMP_GOAL if step == "vcpo" else None,
                           note=f"{shape}; {row['memory'].get('temp_size_in_bytes', 0) / 1e9:.2f} GB temporaries "
                                f"/ tokens (XLA memory_analysis)")]
    if row.get("temp_fit"):
      f = row["temp_fit"]
      out.append(records.figure(
          f"{key}_temp_mb_per_extra_token", f"{title} step XLA temporaries, MB per extra token (fit over B)",
          value=f["per_token_mb"], unit="MB", goal=TEMP_GOAL if step == "vcpo" else None,
          note=f"{shape}; B={f['B2']} and B={row['B']}: {f['fixed_gb']:.2f} GB fixed + {f['per_token_mb']:.3f} MB "
               f"per token -> {f['predicted_gb']:.1f} GB at {f['predict_tokens']} tokens"))
  return out


def render_markdown(result: dict) -> str:
  lines = [f"# Compiled learner step on abstract inputs ({result['model']})", "",
           f"- date: {result['date_utc']}; commit: {result['commit']}",
           f"- machine: {result['cpu_model']}, {result['cpu_cores']} cores; backend {result['backend']}; "
           + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
           f"- knobs present: {result['knobs_present'] or 'none'}", "",
           "| variant | layers | B x T | trace+lower s | XLA compile s | total s (wall) | CPU s | temporaries GB "
           "| MB / token | load avg before/after |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    if r.get("error"):
      lines.append(f"| {r['variant']} | {r['layers']} | {r['B']} x {r['T']} | error: {r['error']} |  |  |  |  |  |  |")
      continue
    temp = r["memory"].get("temp_size_in_bytes")
    lines.append(f"| {r['variant']} | {r['layers']} | {r['B']} x {r['T']} | {r['lower_s']} | {r['compile_s']} | "
                 f"{r['total_s']} | {r.get('cpu_s', '-')} | {temp / 1e9 if temp is not None else float('nan'):.2f} | "
                 f"{r['temp_mb_per_token']:.3f} | {'/'.join(map(str, r.get('load_avg_1min', ['-'])))} |")
  for r in result["rows"]:
    if r.get("temp_fit"):
      f = r["temp_fit"]
      lines.append(f"\n{r['variant']} ({r['layers']} layers): compiled again at B={f['B2']}: temporaries = "
                   f"{f['fixed_gb']:.2f} GB + {f['per_token_mb']:.3f} MB x tokens "
                   f"(-> {f['predicted_gb']:.1f} GB at B x T = {f['predict_tokens']})")
  return "\n".join(lines) + "\n"
