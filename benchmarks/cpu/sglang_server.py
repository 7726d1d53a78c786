"""One real SGLang server for the benchmarks: started by third_party/launch_sglang.sh, awaited, probed."""
from __future__ import annotations

import os
import subprocess
import time
import urllib.request

import aiohttp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(REPO_ROOT, "third_party", "launch_sglang.sh")


def default_python() -> str:
  return os.environ.get("SGLANG_PYTHON") or os.path.expanduser("~/.cache/vcpo_jax/sglang-cpu/venv/bin/python")


def start(model_dir: str, port: int, log_path: str, *, python: str, device: str, dtype: str, flags=()):
  """launch_sglang.sh on model_dir; `flags`: SGLang's own launch flags (e.g. LoRA's), passed after `--`."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(HOST="127.0.0.1", DEVICE=device, DTYPE=dtype, PYTHON=python, WEIGHT_VERSION="v0")
  if device == "cpu":  # the share of host memory for weights + KV pool: the 0.5B's 2 GB need more than 0.05
    env.setdefault("MEM_FRACTION", "0.2")
  with open(log_path, "w") as log:
    extra = ["--", *flags] if flags else []
    return subprocess.Popen([LAUNCH, model_dir, str(port), *extra], stdout=log, stderr=subprocess.STDOUT, env=env,
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


def version(python: str) -> str | None:
  try:
    return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, timeout=60).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None
