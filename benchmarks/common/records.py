"""Figure records (one row of the results table each) and the entry point every bench_*.py module shares."""
from __future__ import annotations

import argparse
import json
import os
import traceback
from typing import Any, Callable, Mapping

from benchmarks.common import goals
from benchmarks.common import markdown
from benchmarks.common import model_choice
from benchmarks.common import summary


def figure(key: str, title: str, *, value: float | None = None, unit: str = "", goal: str | None = None,
           stats: summary.Stats | None = None, details: Mapping[str, Any] | None = None, note: str = "",
           error: str | None = None) -> dict:
  """One row of the results table. `value` is the headline (the median unless stats is None)."""
  if stats is not None and value is None:
    value = stats.median
  return {
      "key": key, "title": title, "value": value, "unit": unit, "goal": goal,
      "goal_met": None if error else goals.goal_met(value, goal),
      "stats": stats.to_dict() if stats is not None else None,
      "details": dict(details or {}), "note": note, "error": error,
  }


def failed_figure(key: str, title: str, error: str, goal: str | None = None, note: str = "",
                  details: Mapping[str, Any] | None = None) -> dict:
  return figure(key, title, goal=goal, error=error, note=note, details=details)


def run_figure(key: str, title: str, fn: Callable[[], list[dict]], goal: str | None = None) -> list[dict]:
  """Calls a figure producer; any exception becomes a failed figure with its message (the run goes on)."""
  try:
    return list(fn())
  except Exception as e:  # noqa: BLE001 - a benchmark failure must not stop the suite
    traceback.print_exc()
    return [failed_figure(key, title, f"{type(e).__name__}: {e}", goal=goal)]


def bench_parser(description: str, json_help: str = "write the figures as a JSON list to this path"):
  """Every bench module's flags: --quick, --json, --model (a module adds its own)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (smoke test)")
  parser.add_argument("--json", default=None, help=json_help)
  parser.add_argument("--model", default=None, choices=model_choice.MODELS,
                      help=f"default ${model_choice.MODEL_ENV} or auto")
  return parser


def _parse(description, argv, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
  args = (parser or bench_parser(description)).parse_args(argv)
  if args.model:
    os.environ[model_choice.MODEL_ENV] = args.model
  return args


def child_or_parent_main(parser: argparse.ArgumentParser, argv, child: Callable[[argparse.Namespace], Any],
                         produce: Callable[[bool, float], list[dict]]):
  """Entry of a GPU bench that measures in child processes of itself: `child(args)` runs the stage a child's
  flags name and returns its result (written to --json), or None in the parent, which produces the figures
  (each child within $BENCH_JOB_LIMIT_S) and emits them."""
  args = _parse(parser.description, argv, parser)
  result = child(args)
  if result is not None:
    with open(args.json, "w") as f:
      json.dump(result, f, default=float)
    return result
  return emit_figures(produce(args.quick, float(os.environ.get("BENCH_JOB_LIMIT_S", 600))), args.json)


def module_main(produce: Callable[[bool], list[dict]], description: str, argv=None) -> list[dict]:
  """Entry of a bench_*.py module: `--quick` and `--json out.json` (figures written there)."""
  args = _parse(description, argv)
  return emit_figures(produce(args.quick), args.json)


def incremental_main(produce: Callable[[bool, list, str | None], Any], key: str, title: str, description: str,
                     argv=None) -> list[dict]:
  """Entry of a GPU check part that appends each figure to `figs` (and writes --json) as it is measured: a
  failure, or the part's time limit, keeps the figures so far; the failure becomes a failed figure."""
  args = _parse(description, argv)
  figs: list[dict] = []
  try:
    produce(args.quick, figs, args.json)
  except Exception as e:  # noqa: BLE001 - the figures measured so far are kept
    figs.append(failed_figure(key, title, f"{type(e).__name__}: {e}"))
  return emit_figures(figs, args.json)


def emit_figures(figures: list[dict], json_path: str | None) -> list[dict]:
  """A bench module's figures as JSON: written to json_path, or printed when there is none."""
  text = json.dumps(figures, indent=2, default=float)
  if json_path:
    with open(json_path, "w") as f:
      f.write(text)
  else:
    print(text)
  return figures


def write_results(results: Mapping[str, Any], out: str, title: str, sections: list[str]) -> str:
  """A measurement's record: OUT.json (the results) and OUT.md (their page under TITLE with results["command"]
  beneath it, also printed); returns the page."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=2, default=float)
  text = markdown.render_markdown(results, goals=(), title=title, sections=sections)
  text = text.replace(f"# {title}\n", f"# {title}\n\n`{results['command']}`\n", 1)
  with open(out + ".md", "w") as f:
    f.write(text)
  print(text)
  return text
