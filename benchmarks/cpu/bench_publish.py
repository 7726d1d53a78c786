"""Cost of one weight update, per publish arm: the learner's blocked time, the whole publish, the server's pause.

One real SGLang server started by `third_party/launch_sglang.sh` on an exported v0 and serving
`--server-dtype`; random weights at configs/qwen2_5.py's 0.5b shape (or configs/tiny.py's model). Each arm
(ARMS: a name -> a function making its publisher and export dtype) publishes versions in turn the way
HttpBackend does in the RL loop (benchmarks/cpu/publish_rounds.py): wait for the previous publish, dispatch the
HF-layout copy of the params (hf_export.hf_layout, into the last published layout's buffers as HttpBackend
does) and start the publish in the background, then a learner step, emulated by a sleep of
`--step-seconds` (no CPU benchmark times a real one at this shape). Timed per
publish, in the same run: the learner blocked (the wait for the previous publish + the dispatch), the whole
publish (dispatch to confirmed), the export and its parts, SGLang's update call and the server's pause.
The disk arms export where the job does (rollout.publish_dir empty: RAM-backed when the server shares the
host and there is room), "on the workdir's disk" under the workdir. Seconds per GB are per GB of the arm's
own published bytes, which scale with the parameter count: the estimates at 1.5B and 7B.

  python -m benchmarks.cpu.bench_publish --shape=0.5b       # writes benchmarks/results/results-publish.{json,md}
  python -m benchmarks.cpu.bench_publish --shape=tiny --workdir=/tmp/pub --out=/tmp/pub/results-publish
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Callable

from benchmarks.common import environment, records, summary
from benchmarks.cpu import publish_rounds, sglang_server
from benchmarks.cpu.publish_rounds import ArmContext, TimedExport

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = {"0.5b": os.path.join(REPO_ROOT, "benchmarks", "results", "results-publish"),
               "tiny": os.path.join(REPO_ROOT, "benchmarks", "results", "quick", "results-publish")}
SHAPES = tuple(DEFAULT_OUT)
ESTIMATE_SIZES = ("0.5b", "1.5b", "7b")    # configs/qwen2_5.py sizes the seconds per GB are carried to
PROBE_TEXT = "Using the numbers 3, 7, 25, make 46."
GB = 1e9
STEP_NOTE = ("not measured here: no CPU benchmark times a learner step at this shape; the GPU check's `steps` "
             "part (benchmarks/gpu/bench_gpu_step.py, B=64 x T=512) measures it on a GPU")


def job_config(shape: str):
  if shape == "tiny":
    from configs import tiny
    return tiny.get_config()
  from configs import qwen2_5
  return qwen2_5.get_config(shape)


def param_count_and_bytes(model_cfg) -> tuple[int, int]:
  """Parameters and their bytes in the params' dtype (what the export writes), from abstract shapes."""
  import jax
  from vcpo_jax.model import transformer
  shapes = jax.eval_shape(lambda: transformer.init_params(model_cfg, jax.random.PRNGKey(0)))
  leaves = jax.tree.leaves(shapes)
  return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


# -- the arms --------------------------------------------------------------------------------------------
Arm = Callable[[ArmContext], tuple[Any, str, TimedExport]]


def disk_arm(dtype: str) -> Arm:
  """update_weights_from_disk of an export in `dtype` (rollout.publish_dtype)."""
  def make(ctx: ArmContext):
    from vcpo_jax.rollout.servers import publisher as publisher_lib
    export = TimedExport(ctx.tokenizer)
    pub = publisher_lib.WeightPublisher(export, ctx.root, [ctx.url], keep_last=ctx.keep_last,
                                        reference_dir=ctx.reference_dir)
    return pub, dtype, export
  return make


def wire_arm(dtype: str, backend: str = "gloo") -> Arm:
  """rollout.publish=wire: buckets of the same HF layout broadcast over a torch group (gloo on a CPU). The
  server already runs v0 (the publisher adopts it), so every timed round goes over the wire; the first one
  also forms the group and compiles the packing."""
  def make(ctx: ArmContext):
    from vcpo_jax.rollout.servers import publisher as publisher_lib, wire as wire_lib
    export = TimedExport(ctx.tokenizer)
    sender = wire_lib.WireSender(ctx.model_cfg, dtype, backend=backend, timeout_s=300.0)
    pub = publisher_lib.WeightPublisher(export, ctx.root, [ctx.url], keep_last=ctx.keep_last,
                                        reference_dir=ctx.reference_dir, wire=sender)
    pub.adopt(0, ctx.reference_dir)
    return pub, dtype, export
  return make


def tensor_arm(dtype: str) -> Arm:
  """rollout.publish=tensor: buckets of the same HF layout in shared memory, their handles posted to
  /update_weights_from_tensor (the server on this host maps them). The server already runs v0 (adopted)."""
  def make(ctx: ArmContext):
    from vcpo_jax.rollout.servers import publisher as publisher_lib, tensor as tensor_lib
    export = TimedExport(ctx.tokenizer)
    sender = tensor_lib.TensorSender(ctx.model_cfg, dtype, timeout_s=300.0)
    pub = publisher_lib.WeightPublisher(export, ctx.root, [ctx.url], keep_last=ctx.keep_last,
                                        reference_dir=ctx.reference_dir, wire=sender)
    pub.adopt(0, ctx.reference_dir)
    return pub, dtype, export
  return make


# name -> (ArmContext -> (a WeightPublisher; the export dtype; its TimedExport, which a session transport
# uses only for resyncs)). A transport adds its arm here.
ARMS: dict[str, Arm] = {
    "disk float32": disk_arm("float32"),
    "disk bf16": disk_arm("bfloat16"),
    "wire bf16 (gloo)": wire_arm("bfloat16"),
    "tensor bf16 (shared memory)": tensor_arm("bfloat16"),
}


# -- the results -----------------------------------------------------------------------------------------
# (round key, title, goal per GB or None): the per-arm figures, each in s and in s per GB published.
PARTS = (
    ("blocked_s", "learner blocked per update (previous publish + HF-layout dispatch)", "<= 0.3"),
    ("publish_s", "whole publish, end to end (dispatch, export, check, update, confirm)", None),
    ("pause_s", "server out of routing (pause -> update -> confirm -> continue)", None),
    ("export_s", "export (the layout finishing, each leaf written as it is ready, the directory)", None),
    ("device_s", "export part: until the layout's last leaf was cast and transposed on the learner's device "
                 "(the earlier leaves' writes overlap it)", None),
    ("host_copy_s", "export part: the ready leaves to host memory, summed", None),
    ("write_s", "export part: model.safetensors writes, summed (overlapping device)", None),
    ("files_s", "export part: config, tokenizer, modes, rename", None),
    ("update_s", "SGLang update calls (/update_weights_from_disk, or one per bucket: the wire's "
                 "/update_weights_from_distributed, the tensor's /update_weights_from_tensor)", None),
)
GOALS_PER_GB = {("disk bf16", "publish_s"): "<= 1.2", ("disk bf16", "pause_s"): "<= 0.15"}  # the (CPU)
SPLIT = (("blocked_s", "learner blocked"), ("pause_s", "server paused"), ("publish_s", "end to end"),
         ("export_s", "export"), ("device_s", "device"), ("host_copy_s", "host copy"), ("write_s", "write"))


def _slug(name: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def figures(m: dict) -> list[dict]:
  out = []
  for name, arm in m["arms"].items():
    gb = arm["published_bytes"] / GB
    common = (f"{name}: {m['shape']} shape, {arm['published_bytes'] / 1e6:.1f} MB published, SGLang on "
              f"{m['server_device']} serving {m['server_dtype']}, learner step emulated as {m['step_seconds']} s")
    for key, title, goal in PARTS:
      seconds = [r[key] for r in arm["rounds"] if r.get(key) is not None]
      if not seconds:
        continue
      goal = GOALS_PER_GB.get((name, key), goal)
      out.append(records.figure(f"{_slug(name)}_{key}", f"{name}: {title}, s", stats=summary.summarize(seconds),
                                unit="s", note=common))
      out.append(records.figure(f"{_slug(name)}_{key}_per_gb", f"{name}: {title}, s per GB",
                                stats=summary.summarize([x / gb for x in seconds]), unit="s/GB", goal=goal,
                                note=common))
  out.append(records.figure("learner_step_s", "learner step at this shape, s", unit="s", note=STEP_NOTE))
  return out


def estimates(m: dict, figs: list[dict]) -> list[dict]:
  """Seconds at each Qwen2.5 size: each arm's measured medians in s per GB times that size's parameter
  count times the arm's bytes per parameter."""
  from vcpo_jax.model import hf
  per_gb = {f["key"]: f["value"] for f in figs if f["key"].endswith("_per_gb")}
  rows = []
  for size in ESTIMATE_SIZES:
    count, _ = param_count_and_bytes(hf.model_config(job_config(size).model))
    for name, arm in m["arms"].items():
      gb = count * arm["published_bytes"] / m["param_count"] / GB
      rows.append({"size": size, "arm": name, "params": count, "gb": gb,
                   **{key: per_gb[f"{_slug(name)}_{key}_per_gb"] * gb
                      for key in ("blocked_s", "publish_s", "pause_s")
                      if f"{_slug(name)}_{key}_per_gb" in per_gb}})
  return rows


def estimates_section(rows: list[dict], shape: str) -> str:
  lines = ["## Estimated at the Qwen2.5 sizes", "",
           "Each arm's medians in s per GB above times each size's published bytes (configs/qwen2_5.py's "
           "parameter count times the arm's bytes per parameter)."
           + (" From the tiny shape fixed costs dominate: these are no estimate." if shape == "tiny" else ""), "",
           "| size | arm | params | GB published | learner blocked s | whole publish s | server paused s |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    cells = " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in ("blocked_s", "publish_s", "pause_s"))
    lines.append(f"| {r['size']} | {r['arm']} | {r['params'] / 1e9:.3f} B | {r['gb']:.2f} | {cells} |")
  return "\n".join(lines)


def rounds_section(m: dict) -> str:
  lines = ["## Publishes", "", f"Server ready in {m['server_ready_s']:.1f} s on the exported v0 "
           f"({m['server_dtype']}).", "",
           "| arm | version | blocked s | publish s | export s | update s | pause s | each admin call, s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
  for name, arm in m["arms"].items():
    for r in arm["rounds"]:
      calls = ", ".join(f"{path} {s:.2f}" for path, s in r.get("admin_calls", []))
      lines.append(f"| {name} | v{r['version']} | {fmt(r['blocked_s'])} | {fmt(r.get('publish_s'))} | "
                   f"{fmt(r.get('export_s'))} | {fmt(r.get('update_s'))} | {fmt(r.get('pause_s'))} | {calls} |")
  lines.append("")
  for name, arm in m["arms"].items():
    before, after = arm["probe"]["logprobs_before"], arm["probe"]["logprobs_after"]
    diff = max(abs(a - b) for a, b in zip(before, after))
    lines.append(f"Served weights changed ({name}): a {len(arm['probe']['ids'])}-token probe's prompt log-probs "
                 f"moved by up to {diff:.3g} between {arm['probe']['version_before']} and "
                 f"{arm['probe']['version_after']}.")
  return "\n".join(lines)


def split_section(m: dict, figs: list[dict]) -> str:
  """Each arm's medians from the same run, in s per GB published: where its time goes."""
  by_key = {f["key"]: f["value"] for f in figs}
  lines = ["## Same-run split, s per GB (medians)", "",
           f"Exports under {m.get('publish_root')} ({m.get('publish_root_filesystem')}).", "",
           "| arm | " + " | ".join(title for _, title in SPLIT) + " |", "|" + " --- |" * (len(SPLIT) + 1)]
  for name in m["arms"]:
    cells = [by_key.get(f"{_slug(name)}_{key}_per_gb") for key, _ in SPLIT]
    lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:.3g}" for c in cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="0.5b", choices=SHAPES,
                      help="0.5b: configs/qwen2_5.py:0.5b's model; tiny: configs/tiny.py's (the test's)")
  parser.add_argument("--repeats", type=int, default=5, help="timed publishes per arm; medians reported")
  parser.add_argument("--warmup", type=int, default=0, help="publishes per arm before the timed ones, not "
                      "reported (compiles; under a RAM-backed root the first keep_versions files are new)")
  parser.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default per shape: "
                      + ", ".join(f"{k}: {os.path.relpath(v, REPO_ROOT)}" for k, v in DEFAULT_OUT.items()) + ")")
  parser.add_argument("--workdir", default=None, help="exports and the server log kept here (default: a "
                      "temporary directory, removed)")
  parser.add_argument("--sglang-python", default=sglang_server.default_python(),
                      help="interpreter with SGLang (default $SGLANG_PYTHON or the CPU venv)")
  parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="launch_sglang.sh's DEVICE")
  parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms of {list(ARMS)}")
  parser.add_argument("--step-seconds", type=float, default=10.0,
                      help="the emulated learner step each publish overlaps (a sleep)")
  parser.add_argument("--server-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                      help="the dtype SGLang serves (launch_sglang.sh's DTYPE) and v0 is exported in")
  parser.add_argument("--publish-dir", default="", help="rollout.publish_dir for the arms' exports (default: "
                      "empty, the job's choice for a server on this host)")
  parser.add_argument("--note", default="", help="a line for the results (e.g. what else ran on the machine)")
  parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds for the server to start")
  args = parser.parse_args(argv)
  if args.repeats < 1 or args.warmup < 0:
    parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}")
  args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
  unknown = [a for a in args.arms if a not in ARMS]
  if unknown or not args.arms:
    parser.error(f"--arms must name arms of {list(ARMS)}, got {unknown or args.arms}")
  if not args.step_seconds >= 0:
    parser.error(f"--step-seconds must be >= 0, got {args.step_seconds}")
  if not os.path.exists(args.sglang_python):
    parser.error(f"--sglang-python={args.sglang_python!r} does not exist (tests/sglang/install_sglang_cpu.sh "
                 "installs SGLang's CPU venv)")
  command = "python -m benchmarks.cpu.bench_publish " + " ".join(sys.argv[1:] if argv is None else argv)
  env = environment.environment()
  env["model"] = f"qwen2.5-{args.shape}" if args.shape != "tiny" else "tiny"
  env["versions"]["sglang"] = sglang_server.version(args.sglang_python)
  if args.workdir:
    os.makedirs(args.workdir, exist_ok=True)
    m = publish_rounds.measure(args, args.workdir, job_config(args.shape), ARMS, PROBE_TEXT)
  else:
    with tempfile.TemporaryDirectory(prefix="bench_publish-") as tmp:
      m = publish_rounds.measure(args, tmp, job_config(args.shape), ARMS, PROBE_TEXT)
  figs = figures(m)
  results = {"command": command, "environment": env, "figures": figs, "estimates": estimates(m, figs),
             "learner_step": {"measured": False, "note": STEP_NOTE}, **m}
  if args.note:
    results["note"] = args.note
  records.write_results(results, args.out or DEFAULT_OUT[args.shape], "Cost of a weight update, per publish arm",
                        [split_section(m, figs), estimates_section(results["estimates"], args.shape), rounds_section(m)])
  return results


if __name__ == "__main__":
  main()
