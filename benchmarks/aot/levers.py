"""The GPU sweep's levers compiled for an H100 on this CPU machine (benchmarks/aot): memory, largest arrays and
custom calls of the GRPO step per lever, side by side, before any GPU time is spent.

  make aot-gpu-levers        # -> benchmarks/aot/results-gpu-levers.md (and .json); ~20-60 s of compile per lever
  make aot-gpu-levers AOT_ARGS="--steps grpo,vcpo_bounded --levers baseline,causal"

Runs in the venv `make aot-gpu` builds; each lever of benchmarks/gpu/gpu_sweep_levers.LEVERS is compiled as
benchmarks.aot.gpu compiles a --variant, with the same overrides (xla_* ones as compiler options).
"""
from __future__ import annotations

import argparse
import os
import sys

from benchmarks.gpu import gpu_sweep_levers as levers_lib

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results-gpu-levers")


def cases(names: list[str], steps: list[str]):
  """One compile case per (lever, step): the GPU check's config with the lever's overrides, B=64 x T=512."""
  from benchmarks.aot import compile_step
  out = []
  for name in names:
    lever = levers_lib.by_name(name)
    for step in steps:
      label = name if len(steps) == 1 else f"{name}/{step}"
      out.append(compile_step.Case("qwen2.5-0.5b", step, 64, 512, lever.overrides, label))
  return out


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--levers", default=",".join(lever.name for lever in levers_lib.LEVERS))
  parser.add_argument("--steps", default="grpo")
  parser.add_argument("--out", default=DEFAULT_OUT)
  args = parser.parse_args(argv)
  from benchmarks.aot import compile_step
  from benchmarks.aot import gpu
  from benchmarks.aot import report
  from benchmarks.aot import targets
  devices, target = targets.gpu_devices("h100", 1)
  results = []
  for case in cases([n.strip() for n in args.levers.split(",") if n.strip()],
                    [s.strip() for s in args.steps.split(",") if s.strip()]):
    print(f"compiling {case.label} for {target.device_kind} ...", flush=True)
    results.append(compile_step.compile_case(case, devices, target))
  command = " ".join(["python -m benchmarks.aot.levers"] + list(sys.argv[1:] if argv is None else argv))
  text = report.write(args.out, "The GPU sweep's levers compiled for an H100 (deviceless)", gpu.INTRO, results,
                      command=command)
  print(text)
  return results


if __name__ == "__main__":
  main()
