"""Summarises a sweep root as a markdown table: base/final accuracy and the worst ESS ratio per unit."""
from __future__ import annotations

import argparse
import json
import os


def _read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def summarize(root: str) -> list[dict]:
  rows = []
  for name in sorted(os.listdir(root)):
    unit = os.path.join(root, name)
    if not os.path.isdir(unit):
      continue
    result = json.load(open(os.path.join(unit, "result.json"))) if os.path.exists(
        os.path.join(unit, "result.json")) else {}
    scalars = _read_jsonl(os.path.join(unit, "metrics.jsonl"))
    ess = [s["ess_ratio"] for s in scalars if "ess_ratio" in s]
    rows.append({"unit": name, "steps": result.get("steps", len(scalars)),
                 "base_greedy": result.get("base", {}).get("eval/greedy_accuracy"),
                 "final_greedy": result.get("final", {}).get("eval/greedy_accuracy"),
                 "final_sampled": result.get("final", {}).get("eval/sampled_accuracy"),
                 "min_ess_ratio": min(ess) if ess else None,
                 "skipped_updates": scalars[-1].get("skipped_updates") if scalars else None})
  return rows


def to_markdown(rows: list[dict]) -> str:
  cols = ["unit", "steps", "base_greedy", "final_greedy", "final_sampled", "min_ess_ratio", "skipped_updates"]
  fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("root")
  args = parser.parse_args(argv)
  print(to_markdown(summarize(args.root)))


if __name__ == "__main__":
  main()
