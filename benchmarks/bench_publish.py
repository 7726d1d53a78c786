"""Cost of one weight update, per publish arm: the learner's blocked time, the whole publish, the server's pause.

One real SGLang server started by `third_party/launch_sglang.sh` on an exported v0 and serving
`--server-dtype`; random weights at configs/qwen2_5.py's 0.5b shape (or configs/tiny.py's model). Each arm
(ARMS: a name -> a function making its publisher and export dtype) publishes versions in turn the way
HttpBackend does in the RL loop: wait for the previous publish, dispatch the HF-layout copy of the params
(hf_export.hf_layout) and start the publish in the background, then a learner step, emulated by a sleep of
`--step-seconds` (no CPU benchmark times a real one at this shape). Timed per publish: the learner blocked
(the wait for the previous publish + the dispatch), the whole publish (dispatch to confirmed), the export,
SGLang's update call and the server's pause. Seconds per GB are per GB of the arm's own published bytes,
which scale with the parameter count: the estimates at 1.5B and 7B.

  python -m benchmarks.bench_publish --shape=0.5b       # writes benchmarks/results-publish.{json,md}
  python -m benchmarks.bench_publish --shape=tiny --workdir=/tmp/pub --out=/tmp/pub/results-publish
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Callable

import aiohttp

from benchmarks import environment, markdown, records, summary

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO_ROOT, "third_party", "launch_sglang.sh")
DEFAULT_OUT = {"0.5b": os.path.join(REPO_ROOT, "benchmarks", "results-publish"),
               "tiny": os.path.join(REPO_ROOT, "benchmarks", "results", "quick", "results-publish")}
SHAPES = tuple(DEFAULT_OUT)
ESTIMATE_SIZES = ("0.5b", "1.5b", "7b")    # configs/qwen2_5.py sizes the seconds per GB are carried to
PROBE_TEXT = "Using the numbers 3, 7, 25, make 46."
GB = 1e9
STEP_NOTE = ("not measured here: no CPU benchmark times a learner step at this shape; the GPU check's `steps` "
             "part (benchmarks/bench_gpu_step.py, B=64 x T=512) measures it on a GPU")


def default_sglang_python() -> str:
  return os.environ.get("SGLANG_PYTHON") or os.path.expanduser("~/.cache/vcpo_jax/sglang-cpu/venv/bin/python")


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


# -- the server ------------------------------------------------------------------------------------------
def start_server(model_dir: str, port: int, log_path: str, *, python: str, device: str, dtype: str):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(HOST="127.0.0.1", DEVICE=device, DTYPE=dtype, PYTHON=python, WEIGHT_VERSION="v0")
  if device == "cpu":  # the share of host memory for weights + KV pool: the 0.5B's 2 GB need more than 0.05
    env.setdefault("MEM_FRACTION", "0.2")
  with open(log_path, "w") as log:
    return subprocess.Popen([LAUNCH, model_dir, str(port)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, log_path: str, timeout: float) -> float:
  """Seconds until /get_model_info answers; the server's log tail in the error when it exits or times out."""
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout:
    if proc.poll() is not None:
      break
    try:
      with urllib.request.urlopen(url + "/get_model_info", timeout=2) as r:
        if r.status == 200:
          return time.monotonic() - t0
    except OSError:
      pass
    time.sleep(1.0)
  with open(log_path) as f:
    tail = f.read()[-3000:]
  raise RuntimeError(f"SGLang at {url} not ready (exit code {proc.poll()}) after {time.monotonic() - t0:.0f} s; "
                     f"its log {log_path} ends:\n{tail}")


async def get_json(session: aiohttp.ClientSession, url: str, path: str, payload: dict | None = None):
  async with session.request("POST" if payload is not None else "GET", url + path, json=payload) as resp:
    body = await resp.json(content_type=None)
    if resp.status != 200:
      raise RuntimeError(f"{path} answered {resp.status}: {body!r:.300}")
    return body


async def prompt_logprobs(session: aiohttp.ClientSession, url: str, ids: list[int]) -> list[float]:
  """The served model's log-prob of each of ids[1:] given the ids before it (SGLang's prompt log-probs)."""
  body = await get_json(session, url, "/generate", {
      "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
      "return_logprob": True, "logprob_start_len": 0})
  entries = body["meta_info"]["input_token_logprobs"]
  scored = [(lp, tok) for lp, tok, *_ in entries if lp is not None]
  if [tok for _, tok in scored] != ids[1:]:
    raise RuntimeError(f"prompt log-probs of {ids} came back for tokens {[tok for _, tok in scored]}")
  return [float(lp) for lp, _ in scored]


# -- the arms --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ArmContext:
  """What an arm's publisher is built from: one server, the job's model and tokenizer, its own weights root."""
  model_cfg: Any
  tokenizer: Any
  url: str
  root: str
  reference_dir: str
  keep_last: int


class TimedExport:
  """The job's export function (HttpBackend._export: hf_export.write_hf with the job's tokenizer), timed."""

  def __init__(self, tokenizer):
    self.tokenizer, self.seconds = tokenizer, []

  def __call__(self, layout, out_dir: str) -> None:
    from vcpo_jax.model import hf_export
    t0 = time.perf_counter()
    hf_export.write_hf(layout, out_dir, self.tokenizer)
    self.seconds.append(time.perf_counter() - t0)


def disk_arm(dtype: str) -> Callable[[ArmContext], tuple[Any, str, list]]:
  """update_weights_from_disk of an export in `dtype` (rollout.publish_dtype)."""
  def make(ctx: ArmContext):
    from vcpo_jax.rollout.servers import publisher as publisher_lib
    export = TimedExport(ctx.tokenizer)
    pub = publisher_lib.WeightPublisher(export, ctx.root, [ctx.url], keep_last=ctx.keep_last,
                                        reference_dir=ctx.reference_dir)
    return pub, dtype, export.seconds
  return make


def wire_arm(dtype: str, backend: str = "gloo") -> Callable[[ArmContext], tuple[Any, str, list]]:
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
    return pub, dtype, export.seconds
  return make


# name -> (ArmContext -> (publisher with publish(layout, version), pause_seconds, close(); the export dtype;
# the list its export appends seconds to, or [] when it has no export)). The wire publisher adds its arm here.
ARMS: dict[str, Callable[[ArmContext], tuple[Any, str, list]]] = {
    "disk float32": disk_arm("float32"),
    "disk bf16": disk_arm("bfloat16"),
    "wire bf16 (gloo)": wire_arm("bfloat16"),
}


# -- the measurement -------------------------------------------------------------------------------------
async def publish_rounds(make_arm, ctx: ArmContext, params_by_version, probe_ids: list[int],
                         step_s: float) -> dict:
  """Publishes each version as HttpBackend does in the RL loop, a learner step (sleep) after each start."""
  from vcpo_jax.model import hf_export
  from vcpo_jax.rollout.servers import background
  pub, dtype, export_seconds = make_arm(ctx)
  calls: list[tuple[int, str, float]] = []
  admin_call = pub._admin.call
  current = [None]

  async def timed_call(url, method, path, payload=None):
    # The publisher's own admin calls, timed by endpoint: the update call alone, without pause and confirm.
    t0 = time.perf_counter()
    try:
      return await admin_call(url, method, path, payload)
    finally:
      calls.append((current[0], path, time.perf_counter() - t0))

  pub._admin.call = timed_call
  wire_call = getattr(pub, "_wire_admin", None) and pub._wire_admin.call

  async def timed_wire_call(url, method, path, payload=None):
    t0 = time.perf_counter()
    try:
      return await wire_call(url, method, path, payload)
    finally:
      calls.append((current[0], path, time.perf_counter() - t0))

  if wire_call:
    pub._wire_admin.call = timed_wire_call
  pending, rounds, versions = background.BackgroundPublish(), [], sorted(params_by_version)
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
    before = await prompt_logprobs(session, ctx.url, probe_ids)
    info0 = await get_json(session, ctx.url, "/get_model_info")
    try:
      for version in versions + [None]:
        t0 = time.perf_counter()
        await pending.wait()  # the previous version is live (or its error raised)
        waited = time.perf_counter() - t0
        if rounds:
          rounds[-1].update(publish_s=rounds[-1]["dispatch_s"] + pending.last_seconds)
        if version is None:
          break
        current[0] = version
        t1 = time.perf_counter()
        layout = hf_export.hf_layout(params_by_version[version], ctx.model_cfg, dtype)
        pending.start(functools.partial(pub.publish, layout, version))
        t2 = time.perf_counter()
        rounds.append({"version": version, "dtype": dtype, "waited_s": waited, "dispatch_s": t2 - t1,
                       "blocked_s": waited + t2 - t1})
        await asyncio.sleep(step_s)  # the learner step the publish overlaps
    finally:
      await pending.cancel()
      await pub.close()
    for r in rounds:
      mine = [(path, s) for v, path, s in calls if v == r["version"]]
      r["admin_calls"] = [[path.lstrip("/"), round(s, 4)] for path, s in mine]
      r["update_s"] = sum(s for path, s in mine if path in ("/update_weights_from_disk",
                                                               "/update_weights_from_distributed"))
    for r, pause in zip(rounds, pub.pause_seconds[-len(rounds):]):
      r["pause_s"] = pause
    for r, export_s in zip(rounds, export_seconds[-len(rounds):] if export_seconds else [None] * len(rounds)):
      r["export_s"] = export_s
    info = await get_json(session, ctx.url, "/get_model_info")
    after = await prompt_logprobs(session, ctx.url, probe_ids)
  if info.get("weight_version") != f"v{versions[-1]}":
    raise RuntimeError(f"the server reports {info.get('weight_version')!r} after publishing v{versions[-1]}")
  return {"rounds": rounds, "probe": {"ids": probe_ids, "logprobs_before": before, "logprobs_after": after,
                                      "version_before": info0.get("weight_version"),
                                      "version_after": info.get("weight_version")}}


def measure(args, workdir: str) -> dict:
  import jax
  from vcpo_jax.model import hf, hf_export, tokenizer as tokenizer_lib, transformer
  from vcpo_jax.rollout.servers import launcher, weight_store
  config = job_config(args.shape)
  model_cfg = hf.model_config(config.model)
  tok = tokenizer_lib.for_model(config.model.get("hf_path", ""))  # the job's: ours without hf_path
  root = os.path.join(workdir, "weights")
  os.makedirs(root, exist_ok=True)
  # Random inits: seed 0 for the v0 the server starts on, then seeds 1 and 2 alternated, so every update
  # changes every tensor and the last version's weights are never v0's.
  v0_dir = weight_store.export_version(
      lambda p, d: hf_export.export(p, model_cfg, d, tok, args.server_dtype),
      transformer.init_params(model_cfg, jax.random.PRNGKey(0)), root, 0)
  inits = [transformer.init_params(model_cfg, jax.random.PRNGKey(seed)) for seed in (1, 2)]
  jax.block_until_ready(inits)
  port = launcher.free_port()
  url, log_path = f"http://127.0.0.1:{port}", os.path.join(workdir, "sglang.log")
  proc = start_server(v0_dir, port, log_path, python=args.sglang_python, device=args.device,
                      dtype=args.server_dtype)
  arms = {}
  try:
    ready_s = wait_ready(proc, url, log_path, args.server_timeout)
    first, served = 1, None  # served: the init the server holds (None: v0's)
    for name in args.arms:
      ctx = ArmContext(model_cfg, tok, url, os.path.join(workdir, "arms", name.replace(" ", "_")), v0_dir,
                       config.rollout.keep_versions)
      # Consecutive versions alternate the two inits, the arm's last one differing from what was served
      # before it: its probe shows the served weights changed.
      order = [((served or 0) + args.repeats - j) % 2 for j in range(args.repeats)]
      out = asyncio.run(publish_rounds(ARMS[name], ctx, {first + j: inits[i] for j, i in enumerate(order)},
                                       tok.encode(PROBE_TEXT), args.step_seconds))
      served = order[-1]
      count, _ = param_count_and_bytes(model_cfg)
      out["published_bytes"] = count * _itemsize(out["rounds"][0]["dtype"])
      arms[name], first = out, first + args.repeats
  finally:
    launcher.end_process_tree(proc, grace_s=10.0)
  count, param_bytes = param_count_and_bytes(model_cfg)
  return {"arms": arms, "shape": args.shape, "param_count": count, "param_bytes": param_bytes,
          "param_dtype": model_cfg.param_dtype, "server_dtype": args.server_dtype, "server_ready_s": ready_s,
          "server_device": args.device, "step_seconds": args.step_seconds, "root": root if args.workdir else None}


def _itemsize(dtype: str) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


# -- the results -----------------------------------------------------------------------------------------
# (round key, title, goal per GB or None): the per-arm figures, each in s and in s per GB published.
PARTS = (
    ("blocked_s", "learner blocked per update (previous publish + HF-layout dispatch)", "<= 0.3"),
    ("publish_s", "whole publish, end to end (dispatch, export, check, update, confirm)", None),
    ("pause_s", "server out of routing (pause -> update -> confirm -> continue)", None),
    ("export_s", "export (host copy + model.safetensors)", None),
    ("update_s", "SGLang update calls (/update_weights_from_disk, or the wire's /update_weights_from_distributed, one per bucket)", None),
)
GOALS_PER_GB = {("disk bf16", "publish_s"): "<= 1.2"}  # the goals (per GB, CPU)


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


def sglang_version(python: str) -> str | None:
  try:
    return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, timeout=60).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="0.5b", choices=SHAPES,
                      help="0.5b: configs/qwen2_5.py:0.5b's model; tiny: configs/tiny.py's (the test's)")
  parser.add_argument("--repeats", type=int, default=5, help="timed publishes (versions 1..N); medians reported")
  parser.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default per shape: "
                      + ", ".join(f"{k}: {os.path.relpath(v, REPO_ROOT)}" for k, v in DEFAULT_OUT.items()) + ")")
  parser.add_argument("--workdir", default=None, help="exports and the server log kept here (default: a "
                      "temporary directory, removed)")
  parser.add_argument("--sglang-python", default=default_sglang_python(),
                      help="interpreter with SGLang (default $SGLANG_PYTHON or the CPU venv)")
  parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="launch_sglang.sh's DEVICE")
  parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms of {list(ARMS)}")
  parser.add_argument("--step-seconds", type=float, default=10.0,
                      help="the emulated learner step each publish overlaps (a sleep)")
  parser.add_argument("--server-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                      help="the dtype SGLang serves (launch_sglang.sh's DTYPE) and v0 is exported in")
  parser.add_argument("--note", default="", help="a line for the results (e.g. what else ran on the machine)")
  parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds for the server to start")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
  unknown = [a for a in args.arms if a not in ARMS]
  if unknown or not args.arms:
    parser.error(f"--arms must name arms of {list(ARMS)}, got {unknown or args.arms}")
  if not args.step_seconds >= 0:
    parser.error(f"--step-seconds must be >= 0, got {args.step_seconds}")
  if not os.path.exists(args.sglang_python):
    parser.error(f"--sglang-python={args.sglang_python!r} does not exist (third_party/install_sglang_cpu.sh "
                 "installs SGLang's CPU venv)")
  command = "python -m benchmarks.bench_publish " + " ".join(sys.argv[1:] if argv is None else argv)
  env = environment.environment()
  env["model"] = f"qwen2.5-{args.shape}" if args.shape != "tiny" else "tiny"
  env["versions"]["sglang"] = sglang_version(args.sglang_python)
  if args.workdir:
    os.makedirs(args.workdir, exist_ok=True)
    m = measure(args, args.workdir)
  else:
    with tempfile.TemporaryDirectory(prefix="bench_publish-") as tmp:
      m = measure(args, tmp)
  figs = figures(m)
  results = {"command": command, "environment": env, "figures": figs, "estimates": estimates(m, figs),
             "learner_step": {"measured": False, "note": STEP_NOTE}, **m}
  if args.note:
    results["note"] = args.note
  out = args.out or DEFAULT_OUT[args.shape]
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=2, default=float)
  title = "Cost of a weight update, per publish arm"
  text = markdown.render_markdown(results, goals=(), title=title,
                                  sections=[estimates_section(results["estimates"], args.shape), rounds_section(m)])
  text = text.replace(f"# {title}\n", f"# {title}\n\n`{command}`\n", 1)
  with open(out + ".md", "w") as f:
    f.write(text)
  print(text)
  return results


if __name__ == "__main__":
  main()
