"""The GPU check's report: its parts' outputs read back (figures, the job's accuracy and rate, the unit tier's
junit XML) into gpu_check.json, results-gpu.md and details.tar.gz."""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import statistics
import tarfile
import time
import xml.etree.ElementTree as ET
from typing import Any, Mapping

from benchmarks.common import goals as goals_lib
from benchmarks.gpu import gpu_sweep_report
from benchmarks.common import markdown

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_FILES = ("result.json", "metrics.jsonl", "config.json")   # what of the job's workdir is kept
STEADY_SKIP = 2            # first RL steps left out of the rate (compilation, pipeline fill)


def read_json(path: str, default=None):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return default


def environment(work: str) -> dict:
  """The env part's probe (the last line of its log is JSON), or what this process can tell without jax."""
  try:
    with open(os.path.join(work, "env.log")) as f:
      return json.loads(f.read().strip().splitlines()[-1])
  except (OSError, ValueError, IndexError):
    from benchmarks.common import environment as env_lib
    return {"error": "the env part wrote no probe", "versions": env_lib.package_versions(),
            "cpu_model": env_lib.cpu_model(), "cpu_cores": os.cpu_count()}


def job_summary(workdir: str) -> dict:
  """Held-out accuracy (warm start and after RL) from result.json; steps per second from metrics.jsonl's
  per-step wall time (the steps after the first STEADY_SKIP, or the later half when there are fewer)."""
  result = read_json(os.path.join(workdir, "result.json"), {}) or {}
  seconds = []
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        if line.endswith("\n"):
          with_s = json.loads(line).get("throughput/step_seconds")
          if with_s is not None:
            seconds.append(float(with_s))
  except (OSError, ValueError):
    pass
  out = {"finished": bool(result), "steps_logged": len(seconds)}
  for phase in ("base", "final"):
    for key in ("eval/greedy_accuracy", "eval/sampled_accuracy"):
      value = (result.get(phase) or {}).get(key)
      if value is not None:
        out[f"{phase}_{key.split('/')[1]}"] = value
  if seconds:
    steady = seconds[min(STEADY_SKIP, len(seconds) // 2):]
    out.update(steps_per_s=len(steady) / sum(steady), steady_steps=len(steady),
               all_steps_per_s=len(seconds) / sum(seconds), median_step_s=statistics.median(steady))
  return out


def unit_summary(work: str) -> dict:
  """Counts, failed tests and skip reasons from the junit XML; the log's last summary line if there is none."""
  path = os.path.join(work, "unit.xml")
  try:
    root = ET.parse(path).getroot()
  except (OSError, ET.ParseError):
    return {"junit": False, **log_counts(os.path.join(work, "unit.log"))}
  counts = collections.Counter()
  failures, skips = [], collections.Counter()
  for case in root.iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
    kind = kinds[0] if kinds else "passed"
    counts[kind] += 1
    child = case.find(kind) if kinds else None
    message = " ".join(((child.get("message") if child is not None else "") or "").split())
    if kind in ("failure", "error"):
      failures.append({"test": name, "kind": kind, "message": message[:300]})
    elif kind == "skipped":
      skips[message[:160]] += 1
  return {"junit": True, "tests": sum(counts.values()), "passed": counts["passed"], "failed": counts["failure"],
          "errors": counts["error"], "skipped": counts["skipped"], "failures": failures,
          "skip_reasons": dict(skips.most_common(15))}


def log_counts(path: str) -> dict:
  """'3 failed, 10 passed, 2 skipped' (pytest's last summary line) as counts."""
  try:
    with open(path, errors="replace") as f:
      text = f.read()
  except OSError:
    return {}
  counts = {}
  for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", text[-3000:]):
    counts["errors" if word.startswith("error") else word] = int(n)
  return counts


def collect(work: str, parts: list[dict], *, dry: bool, command: str, started: float) -> dict:
  figures = []
  for name in ("steps", "decode", "wire", "sweep"):
    if any(p["part"] == name for p in parts):
      figures += read_json(os.path.join(work, f"{name}.json"), []) or []
  return {"environment": environment(work), "command": command,
          "mode": "dry (small shapes on the CPU; not a GPU measurement)" if dry else "gpu",
          "parts": parts, "figures": figures, "job": job_summary(os.path.join(work, "job")),
          "unit": unit_summary(work), "wall_seconds": round(time.monotonic() - started, 1)}


def parts_section(parts: list[dict]) -> str:
  lines = ["## Parts", "", "| part | status | seconds | limit (s) |", "| --- | --- | --- | --- |"]
  for p in parts:
    lines.append(f"| {p['part']} | {p['status']} | {p['seconds']:.0f} | {p['limit_s']:.0f} |")
  return "\n".join(lines)


def job_section(job: Mapping[str, Any]) -> str:
  f = lambda key, spec=".3f": "-" if job.get(key) is None else format(job[key], spec)
  return "\n".join([
      "## Main job, shortened (warm start + RL, async k=2, learner and one embedded server on one device)", "",
      "| finished | RL steps logged | held-out greedy accuracy: warm start -> after RL | sampled accuracy | "
      "RL steps/s (steady; all) | median step (s) |", "| --- | --- | --- | --- | --- | --- |",
      f"| {'yes' if job.get('finished') else 'NO'} | {job.get('steps_logged', 0)} | {f('base_greedy_accuracy')} -> "
      f"{f('final_greedy_accuracy')} | {f('base_sampled_accuracy')} -> {f('final_sampled_accuracy')} | "
      f"{f('steps_per_s', '.2f')}; {f('all_steps_per_s', '.2f')} | {f('median_step_s')} |"])


def unit_section(unit: Mapping[str, Any]) -> str:
  counts = ", ".join(f"{unit[k]} {k}" for k in ("tests", "passed", "failed", "errors", "skipped") if k in unit)
  lines = ["## Unit tier", "", f"- {counts or 'no result'}" + ("" if unit.get("junit") else " (from the log)")]
  for fail in unit.get("failures", [])[:40]:
    lines.append(f"- {fail['kind']}: `{fail['test']}`: {fail['message'][:200]}")
  for reason, n in unit.get("skip_reasons", {}).items():
    lines.append(f"- skipped x{n}: {reason}")
  return "\n".join(lines)


def render(results: Mapping[str, Any]) -> str:
  goals = "\n".join(markdown.goals_table(results, goals_lib.GPU_CHECK_GOALS)).strip()
  sections = [parts_section(results["parts"]), goals, job_section(results["job"]), unit_section(results["unit"])]
  sweep = gpu_sweep_report.section(results["figures"])
  if sweep:
    sections.append(sweep)
  return markdown.render_markdown(results, goals=(), title="vcpo_jax GPU check", sections=sections)


def write(results: dict, work: str, out: str, copy_to_repo: bool) -> list[str]:
  """gpu_check.json, results-gpu.md (and benchmarks/gpu/results-gpu.md) and details.tar.gz in `out`."""
  with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(results, f, indent=2, default=str)
  md = render(results)
  with open(os.path.join(out, "results-gpu.md"), "w") as f:
    f.write(md)
  if copy_to_repo:
    shutil.copy(os.path.join(out, "results-gpu.md"), os.path.join(REPO_ROOT, "benchmarks", "gpu", "results-gpu.md"))
  with tarfile.open(os.path.join(out, "details.tar.gz"), "w:gz") as tar:
    for name in sorted(os.listdir(work)):
      if name != "job":
        tar.add(os.path.join(work, name), arcname=name)
    for name in JOB_FILES:
      if os.path.exists(os.path.join(work, "job", name)):
        tar.add(os.path.join(work, "job", name), arcname=f"job/{name}")
  return ["gpu_check.json", "results-gpu.md", "details.tar.gz"]


def summary_lines(results: Mapping[str, Any]) -> str:
  """The short table printed last (the device tool's reply carries the end of the output)."""
  lines = [f"{p['part']:>7}: {p['status']} in {p['seconds']:.0f} s" for p in results["parts"]]
  for goal in goals_lib.GPU_CHECK_GOALS:
    text, lands, _ = markdown.goal_row(goal, results["figures"], results["environment"])
    lines.append(f"goal: {text[:60]}... -> {lands}")
  job, unit = results["job"], results["unit"]
  lines.append(f"job: {job}")
  lines.append(f"unit: { {k: unit.get(k) for k in ('tests', 'passed', 'failed', 'errors', 'skipped')} }")
  return "\n".join(lines)
