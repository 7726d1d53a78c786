"""Cost of one weight update: the learner's export and a real SGLang server's update_weights_from_disk.

The job's own publish path (`WeightPublisher`, `weight_store.export_version`, `hf.export_hf` in the params'
dtype) against one server started by `third_party/launch_sglang.sh` on the exported v0 directory, serving
that dtype. Random weights at configs/qwen2_5.py's 0.5b shape (or configs/tiny.py's model); every publish
is timed in parts: the export (device -> host -> model.safetensors), the server's /update_weights_from_disk
call, the server's pause (out of routing: pause -> update -> confirm -> continue) and the whole publish.
The bytes exported scale with the parameter count, so seconds per GB gives the cost at 1.5B and 7B.

  python -m benchmarks.bench_publish --shape=0.5b       # writes benchmarks/results-publish.{json,md}
  python -m benchmarks.bench_publish --shape=tiny --workdir=/tmp/pub --out=/tmp/pub/results-publish
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

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


def dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


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


# -- the measurement -------------------------------------------------------------------------------------
async def publish_rounds(params_by_version, export_fn, root: str, url: str, reference_dir: str,
                         probe_ids: list[int], keep_last: int) -> dict:
  """Publishes each version in turn through the job's WeightPublisher (which deletes all but the newest
  keep_last directories, as in the job); the parts of each publish timed."""
  from vcpo_jax.rollout.servers import publisher as publisher_lib
  versions = sorted(params_by_version)
  pub = publisher_lib.WeightPublisher(export_fn, root, [url], keep_last=keep_last, reference_dir=reference_dir)
  calls: list[tuple[str, float]] = []
  admin_call = pub._admin.call

  async def timed_call(url, method, path, payload=None):
    # The publisher's own admin calls, timed by endpoint: the update call alone, without pause and confirm.
    t0 = time.perf_counter()
    try:
      return await admin_call(url, method, path, payload)
    finally:
      calls.append((path, time.perf_counter() - t0))

  pub._admin.call = timed_call
  rounds = []
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
    before = await prompt_logprobs(session, url, probe_ids)
    info0 = await get_json(session, url, "/get_model_info")
    try:
      for version in versions:
        calls.clear()
        n_exports = len(export_fn.seconds)
        t0 = time.perf_counter()
        ok = await pub.publish(params_by_version[version], version)
        publish_s = time.perf_counter() - t0
        if ok != {url: True} or len(export_fn.seconds) != n_exports + 1:
          raise RuntimeError(f"publish of v{version} failed: {ok}; out of sync: {pub.out_of_sync}")
        info = await get_json(session, url, "/get_model_info")
        rounds.append({"version": version, "export_s": export_fn.seconds[-1], "publish_s": publish_s,
                       "update_s": sum(s for p, s in calls if p == "/update_weights_from_disk"),
                       "update_calls": sum(p == "/update_weights_from_disk" for p, _ in calls),
                       "pause_s": pub.pause_seconds[-1], "served_weight_version": info.get("weight_version"),
                       "admin_calls": [[path, round(s, 4)] for path, s in calls]})
    finally:
      await pub.close()
    after = await prompt_logprobs(session, url, probe_ids)
  return {"rounds": rounds, "probe": {"ids": probe_ids, "logprobs_before": before, "logprobs_after": after,
                                      "version_before": info0.get("weight_version"),
                                      "version_after": rounds[-1]["served_weight_version"]}}


class TimedExport:
  """The job's export function (HttpBackend._export: hf.export_hf with the job's tokenizer), timed."""

  def __init__(self, model_cfg, tokenizer):
    self.model_cfg, self.tokenizer, self.seconds = model_cfg, tokenizer, []

  def __call__(self, params, out_dir: str) -> None:
    from vcpo_jax.model import hf
    t0 = time.perf_counter()
    hf.export_hf(params, self.model_cfg, out_dir, self.tokenizer)
    self.seconds.append(time.perf_counter() - t0)


def measure(args, workdir: str) -> dict:
  import jax
  from vcpo_jax.model import hf, tokenizer as tokenizer_lib, transformer
  from vcpo_jax.rollout.servers import launcher, weight_store
  config = job_config(args.shape)
  model_cfg = hf.model_config(config.model)
  tok = tokenizer_lib.for_model(config.model.get("hf_path", ""))  # the job's: ours without hf_path
  export_fn = TimedExport(model_cfg, tok)
  root = os.path.join(workdir, "weights")
  os.makedirs(root, exist_ok=True)
  # Random inits: seed 0 for the v0 the server starts on, then seeds 1 and 2 alternated, so every update
  # changes every tensor and the last version's weights are never v0's.
  v0_dir = weight_store.export_version(export_fn, transformer.init_params(model_cfg, jax.random.PRNGKey(0)), root, 0)
  nbytes = dir_bytes(v0_dir)
  inits = [transformer.init_params(model_cfg, jax.random.PRNGKey(seed)) for seed in (1, 2)]
  jax.block_until_ready(inits)
  port = launcher.free_port()
  url, log_path = f"http://127.0.0.1:{port}", os.path.join(workdir, "sglang.log")
  proc = start_server(v0_dir, port, log_path, python=args.sglang_python, device=args.device,
                      dtype=model_cfg.param_dtype)
  try:
    ready_s = wait_ready(proc, url, log_path, args.server_timeout)
    out = asyncio.run(publish_rounds({v: inits[(v - 1) % 2] for v in range(1, args.repeats + 1)}, export_fn,
                                     root, url, v0_dir, tok.encode(PROBE_TEXT), config.rollout.keep_versions))
  finally:
    launcher.end_process_tree(proc, grace_s=10.0)
  count, param_bytes = param_count_and_bytes(model_cfg)
  out.update(shape=args.shape, exported_bytes=nbytes, param_count=count, param_bytes=param_bytes,
             param_dtype=model_cfg.param_dtype, server_ready_s=ready_s, server_device=args.device,
             root=root if args.workdir else None)
  return out


# -- the results -----------------------------------------------------------------------------------------
def figures(m: dict) -> list[dict]:
  gb = m["exported_bytes"] / GB
  common = (f"{m['shape']} shape, {m['param_dtype']}, {m['exported_bytes'] / 1e6:.1f} MB exported, SGLang on "
            f"{m['server_device']}")
  out = []
  for key, title, note in (
      ("export_s", "learner export (hf.export_hf: host copy + model.safetensors)", "the publisher's export_fn"),
      ("update_s", "SGLang /update_weights_from_disk", "the call alone"),
      ("pause_s", "server out of routing (pause -> update -> confirm -> continue)", "publisher.pause_seconds"),
      ("publish_s", "whole publish (export, check, rename, update, confirm, old ones deleted)",
       "WeightPublisher.publish")):
    seconds = [r[key] for r in m["rounds"]]
    out.append(records.figure(f"publish_{key}", f"{title}, s", stats=summary.summarize(seconds), unit="s",
                              note=f"{common}; {note}"))
    out.append(records.figure(f"publish_{key}_per_gb", f"{title}, s per GB",
                              stats=summary.summarize([s / gb for s in seconds]), unit="s/GB", note=common))
  out.append(records.figure("learner_step_s", "learner step at this shape, s", unit="s", note=STEP_NOTE))
  return out


def estimates(m: dict, figs: list[dict]) -> list[dict]:
  """Seconds at each Qwen2.5 size from the measured medians in s/GB times that size's bytes (bytes scale
  with the parameter count; each size's params in its own config's dtype)."""
  from vcpo_jax.model import hf
  per_gb = {f["key"]: f["value"] for f in figs if f["key"].endswith("_per_gb")}
  rows = []
  for size in ESTIMATE_SIZES:
    count, nbytes = param_count_and_bytes(hf.model_config(job_config(size).model))
    gb = nbytes / GB
    rows.append({"size": size, "params": count, "gb": gb,
                 **{key: per_gb[f"publish_{key}_per_gb"] * gb for key in ("export_s", "update_s", "publish_s")}})
  return rows


def estimates_section(rows: list[dict], shape: str) -> str:
  lines = ["## Estimated at the Qwen2.5 sizes", "",
           "The medians in s per GB above times each size's parameter bytes (configs/qwen2_5.py, params in its "
           "param_dtype; the bytes scale with the parameter count)."
           + (" From the tiny shape fixed costs dominate: these are no estimate." if shape == "tiny" else ""), "",
           "| size | params | GB | export s | update_weights_from_disk s | whole publish s |",
           "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    lines.append(f"| {r['size']} | {r['params'] / 1e9:.3f} B | {r['gb']:.2f} | {r['export_s']:.1f} | "
                 f"{r['update_s']:.1f} | {r['publish_s']:.1f} |")
  return "\n".join(lines)


def rounds_section(m: dict) -> str:
  lines = ["## Publishes", "", f"Server ready in {m['server_ready_s']:.1f} s on the exported v0.", "",
           "| version | export s | update s | pause s | publish s | served weight_version | each admin call, s |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in m["rounds"]:
    calls = ", ".join(f"{path.lstrip('/')} {s:.2f}" for path, s in r.get("admin_calls", []))
    lines.append(f"| v{r['version']} | {r['export_s']:.2f} | {r['update_s']:.2f} | {r['pause_s']:.2f} | "
                 f"{r['publish_s']:.2f} | {r['served_weight_version']} | {calls} |")
  before, after = m["probe"]["logprobs_before"], m["probe"]["logprobs_after"]
  diff = max(abs(a - b) for a, b in zip(before, after))
  lines += ["", f"Served weights changed: a {len(m['probe']['ids'])}-token probe's prompt log-probs moved by up "
            f"to {diff:.3g} between {m['probe']['version_before']} and {m['probe']['version_after']}."]
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
  parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds for the server to start")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
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
  out = args.out or DEFAULT_OUT[args.shape]
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=2, default=float)
  title = "Cost of a weight update (export + SGLang update_weights_from_disk)"
  text = markdown.render_markdown(results, goals=(), title=title,
                                  sections=[estimates_section(results["estimates"], args.shape), rounds_section(m)])
  text = text.replace(f"# {title}\n", f"# {title}\n\n`{command}`\n", 1)
  with open(out + ".md", "w") as f:
    f.write(text)
  print(text)
  return results


if __name__ == "__main__":
  main()
