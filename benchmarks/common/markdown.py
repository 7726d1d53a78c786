"""The results as markdown: the figures table, the goals table and each figure's details."""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from benchmarks.common import goals as goals_lib


def fmt(x: float | None, unit: str = "") -> str:
  if x is None:
    return "-"
  if unit == "%":
    return f"{100 * x:.2f}%"
  ax = abs(x)
  if ax != 0 and (ax >= 1e5 or ax < 1e-3):
    s = f"{x:.3g}"
  elif ax >= 100:
    s = f"{x:.0f}"
  else:
    s = f"{x:.3g}" if ax < 1 else f"{x:.2f}"
  return f"{s}{unit}" if unit in ("x",) else (f"{s} {unit}" if unit else s)


def _fmt_goal(goal: str | None, unit: str) -> str:
  """'>= 0.5' with unit '%' reads '>= 50.00%'; other goals keep their number and gain the unit."""
  if not goal:
    return "-"
  op, _, rhs = goal.strip().partition(" ")
  try:
    return f"{op} {fmt(float(rhs), unit)}"
  except ValueError:
    return goal


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(results: Mapping[str, Any], goals: Sequence[goals_lib.Goal] = goals_lib.GOALS,
                    title: str = "vcpo_jax benchmark results", sections: Sequence[str] = ()) -> str:
  """The results table (headline figures), the goals table (the goals any figure measures), any further
  markdown `sections` and per-figure details, as markdown."""
  env = results.get("environment", {})
  lines = [f"# {title}", ""]
  if env:
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())
    lines += [f"- date: {env.get('date_utc')}",
              f"- machine: {env.get('cpu_model')}, {env.get('cpu_cores')} cores; {env.get('platform')}"
              + (f"; load average at the start {env['load_avg']}" if env.get("load_avg") else ""),
              f"- backend: {env.get('backend')} ({env.get('devices')}); model: {env.get('model', 'main')}",
              f"- commit: {env.get('commit', 'unknown')}",
              f"- versions: python {env.get('python')}, {versions}"]
  if results.get("command"):
    lines.append(f"- regenerate: `{results['command']}`")
  for key in ("mode", "wall_seconds", "note"):
    if key in results:
      lines.append(f"- {key.replace('_', ' ')}: {results[key]}")
  lines += ["", "| figure | median | min - max | n | goal | met | notes |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
  for fig in results.get("figures", []):
    unit = fig.get("unit", "")
    st = fig.get("stats")
    rng = f"{fmt(st['min'], unit)} - {fmt(st['max'], unit)}" if st else "-"
    met = {True: "yes", False: "NO", None: "-"}[fig.get("goal_met")]
    if fig.get("error"):
      value, met, note = "not measured", "-", f"error: {fig['error']}"
    else:
      value, note = fmt(fig.get("value"), unit), fig.get("note", "")
    lines.append("| " + " | ".join(_cell(c) for c in (
        fig["title"], value, rng, st["n"] if st else "-", _fmt_goal(fig.get("goal"), unit), met, note)) + " |")
  if any(k in {f["key"] for f in results.get("figures", [])} for g in goals for k in g.keys):
    lines += goals_table(results, goals)
  for section in sections:
    lines += ["", section.rstrip("\n")]
  details = [f for f in results.get("figures", []) if f.get("details")]
  if details:
    lines += ["", "## Details", ""]
    for fig in details:
      lines.append(f"- **{fig['key']}**: `{json.dumps(fig['details'], sort_keys=True, default=str)}`")
  return "\n".join(lines) + "\n"


def goal_row(goal: goals_lib.Goal, figures: Sequence[Mapping[str, Any]],
             env: Mapping[str, Any]) -> tuple[str, str, str]:
  """(goal, where it lands, measured on) for the goals table."""
  by_key = {f["key"]: f for f in figures}
  fig = next((by_key[k] for k in goal.keys if k in by_key), None)
  if fig is None:
    return goal.text, "not in this run", "-"
  if fig.get("error"):
    return goal.text, f"not measured: {fig['error'][:120]}", "-"
  met = {True: "met", False: "NOT met", None: "-"}[fig.get("goal_met")]
  lands = f"{fmt(fig.get('value'), fig.get('unit', ''))} ({met})"
  backend = env.get("backend", "?")
  model = env.get("model", "?")
  where = (f"{backend} (compile only, abstract inputs)" if fig["key"].startswith("compile_")
           else f"{backend}, model {model}")
  if goal.needs == "gpu" and backend != "gpu":
    where += "; unverified on GPU"
  elif goal.needs == "gpu" and model != "qwen2.5-0.5b":
    where += "; not the goal's model"
  return goal.text, lands, where


def goals_table(results: Mapping[str, Any], goals: Sequence[goals_lib.Goal] = goals_lib.GOALS) -> list[str]:
  figures = results.get("figures", [])
  env = results.get("environment", {})
  lines = ["", "## Goals", "", "| goal | where it lands | measured on |", "| --- | --- | --- |"]
  for goal in goals:
    lines.append("| " + " | ".join(_cell(c) for c in goal_row(goal, figures, env)) + " |")
  return lines
