"""Command-line options the GPU and TPU compile tools share: --set, --variant, --steps."""
from __future__ import annotations

import argparse

from benchmarks.aot import compile_step


def pair(text: str) -> tuple[str, str]:
  key, eq, value = text.partition("=")
  if not eq or not key:
    raise argparse.ArgumentTypeError(f"expected field=value, got {text!r}")
  return key.strip(), value.strip()


def variant(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
  """"name" or "name:field=value,field=value" -> (name, overrides)."""
  name, _, rest = text.partition(":")
  if not name:
    raise argparse.ArgumentTypeError(f"a variant needs a name: name[:field=value,...], got {text!r}")
  return name, tuple(pair(p) for p in rest.split(",") if p.strip())


def steps(text: str) -> tuple[str, ...]:
  out = tuple(s.strip() for s in text.split(",") if s.strip())
  bad = [s for s in out if s not in compile_step.STEPS]
  if bad or not out:
    raise argparse.ArgumentTypeError(f"--steps must name some of {compile_step.STEPS}, got {text!r}")
  return out


def add_common(parser: argparse.ArgumentParser, default_steps: str):
  parser.add_argument("--set", type=pair, action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config field for every variant (e.g. model.attention=xla; xla_* keys "
                           "are XLA compiler options, e.g. xla_gpu_enable_latency_hiding_scheduler=true)")
  parser.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME[:FIELD=VALUE,...]",
                      help="a column of the comparison: its own overrides on top of --set (repeatable; default: "
                           "one variant, 'baseline')")
  parser.add_argument("--steps", type=steps, default=steps(default_steps),
                      help=f"comma-separated learner steps, of {compile_step.STEPS}")
  parser.add_argument("--top", type=int, default=10, help="how many of the largest arrays to list")


def cases(args, config: str, rows: int | None, seq_len: int | None, settings=()) -> list[compile_step.Case]:
  """One case per (variant, step); labels name the variant where variants were given, the step where several.
  `settings`: (field, value) pairs applied before --set and the variant's own."""
  variants = args.variant or [("baseline", ())]
  out = []
  for name, overrides in variants:
    for step in args.steps:
      label = "/".join(p for p, many in ((name, bool(args.variant)), (step, len(args.steps) > 1)) if many)
      out.append(compile_step.Case(config, step, rows, seq_len, tuple(settings) + tuple(args.set) + overrides,
                                       label or step))
  return out
