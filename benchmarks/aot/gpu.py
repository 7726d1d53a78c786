"""The learner step compiled for an H100 on a CPU machine (no driver): XLA's GPU memory analysis, largest arrays,
custom calls (cuDNN attention variants), for the GPU check's 0.5B shape and any config levers side by side.

  make aot-gpu                                              # the 0.5B shape, GRPO / VCPO bounded / book-keeping
  make aot-gpu AOT_ARGS="--steps grpo --variant base --variant xla:model.attention=xla --out /tmp/levers"

Runs in the venv `make aot-gpu` builds (jax[cuda12] at the project's jax), with JAX_PLATFORMS=cpu: the CUDA
plugin compiles for the described GPU without one. No autotuning, no timings.
"""
from __future__ import annotations

import argparse
import os

from benchmarks.aot import cli
from benchmarks.aot import compile_step
from benchmarks.aot import report
from benchmarks.aot import targets

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results-gpu")
INTRO = ("The learner step compiled ahead of time for the GPU described by benchmarks/aot/h100_sxm.txtpb, on a CPU "
         "machine with no GPU (the CUDA plugin's deviceless compile: the program XLA would run, without "
         "autotuning). Memory is XLA's analysis per device: peak = arguments + outputs + temporaries - aliased; "
         "headroom is against the GPU's whole memory (the allocator preallocates 75% of it by default).")


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="qwen2.5-0.5b",
                      help="bench model name (benchmarks/common/model_choice.py) or config file[:arg]")
  parser.add_argument("--rows", type=int, default=64, help="B, rows of the step's batch")
  parser.add_argument("--seq-len", type=int, default=512, help="T, tokens per row")
  parser.add_argument("--gpu", default="h100", help=f"one of {sorted(targets.GPU_SPECS)} or a target textproto")
  parser.add_argument("--gpus", type=int, default=1, help="GPUs of one host (the config's mesh over them)")
  parser.add_argument("--out", default=DEFAULT_OUT, help="results prefix: writes <out>.md and <out>.json")
  cli.add_common(parser, "grpo,vcpo_bounded,vcpo_book_keeping")
  args = parser.parse_args(argv)
  devices, target = targets.gpu_devices(args.gpu, args.gpus)
  results = []
  for case in cli.cases(args, args.config, args.rows, args.seq_len):
    print(f"compiling {case.label} for {args.gpus} x {target.device_kind} ...", flush=True)
    results.append(compile_step.compile_case(case, devices, target, args.top))
  text = report.write(args.out, "The learner step compiled for an H100 (deviceless)", INTRO, results)
  print(text)
  return results


if __name__ == "__main__":
  main()
