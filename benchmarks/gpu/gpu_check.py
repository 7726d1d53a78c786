"""`make gpu-check`: the prepared check for a bare GPU machine, in two calls of at most 550 s and 410 s.

Runs with the machine's own JAX (and the wheels `make gpu-wheels` carried for what it lacks, installed into a
folder of their own with no network). Each part is a process under its own time limit: at the limit it gets
SIGINT (pytest still writes its report), then what is left of its process tree is killed, the part is recorded
as timed out, and the next part starts. Every part's limit also shrinks to what is left of --budget-s.
The default parts (env, steps, decode, wire) fit one device call; the job and the unit tier are the second
(`--parts env,job,unit --budget-s 410`): together they outgrow the device tool's 600 s per call; the sweep is
a third (`--parts env,sweep --budget-s 505`).

| part   | what it runs                                                                 | GPU limit | dry limit |
| ------ | ---------------------------------------------------------------------------- | --------- | --------- |
| env    | device, versions (benchmarks.common.environment)                                    |   15 s    |   60 s    |
| steps  | 0.5B shape, B=64 x T=512: GRPO MFU, VCPO / GRPO (bounded, book-keeping),     |  160 s    |  160 s    |
|        | peak device memory vs XLA's estimate (benchmarks.gpu.bench_gpu_step)             |           |           |
| decode | 0.5B shape bf16 greedy, B=64 and 256: engine vs HF generate and vs the       |  140 s    |  120 s    |
|        | memory floor (benchmarks.gpu.bench_gpu_decode)                                   |           |           |
| wire   | 0.5B shape: one learner + one embedded server on the device, a weight update |  150 s    |  150 s    |
|        | over the wire (NCCL, else gloo) beside disk; served == learner log-probs     |           |           |
|        | (benchmarks.gpu.bench_gpu_wire)                                                  |           |           |
| job    | the main job shortened: warm start + 20 RL steps, k=2, learner and one       |  200 s    |  150 s    |
|        | embedded server on the one device (dry: configs/tiny.py, 2 RL steps)         |           |           |
| unit   | the unit tier, JAX_PLATFORMS=cuda, 14 workers (dry: two test files, CPU)     |  180 s    |   90 s    |
| sweep  | GEMM ceiling at the model's shapes; GRPO step per lever combination; VCPO at |  480 s    |  360 s    |
|        | the best (benchmarks.gpu.bench_gpu_sweep; its own call: `make gpu-sweep`)        |           |           |
| (wheel install before, report after: ~10 s)                                           |  550 s    |  580 s    |

The GPU limits are the H100 measurements (docs/gpu.md: env 4 s, steps 58 s, decode over 103 s, job 180-186 s,
the unit tier 142 s with 14 workers) plus a margin. The steps part's own deadline must also hold
bench_gpu_step's reserves (MIN_CHILD_S per variant and PEAK_RESERVE_S; tests/test_gpu_check.py checks it).
`--limit unit=150` changes one limit, and `--parts` picks parts (the unit tier; a rerun of what timed out).

Writes under --out (default $OUT, else workdir/gpu_check[_dry]) at most four files, as the device tool brings
back: results-gpu.md (also copied to benchmarks/gpu/results-gpu.md unless --dry), gpu_check.json (every part and
figure), gpu_check.log (this script's log with each part's last lines) and details.tar.gz (each part's log,
the figures' JSON, the unit tier's junit XML, the job's result.json, metrics.jsonl and config.json).

  python3 -m benchmarks.gpu.gpu_check                     # on the GPU machine (docs/gpu.md: the device tool call)
  python -m benchmarks.gpu.gpu_check --dry                # on a CPU: small shapes, the same code path
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGET_S = 550.0
DRY_BUDGET_S = 600.0       # --dry on a loaded 2-core CPU
REPORT_RESERVE_S = 8.0     # kept for the report at the end of the budget
MIN_PART_S = 15.0          # a part given less than this is skipped
STOP_GRACE_S = 10.0        # between SIGINT and killing what is left (pytest writes its junit XML meanwhile)
DRY_TESTS = ("tests/test_rewards.py", "tests/test_ring_store.py")
GPU_TEST_WORKERS = 14      # pytest-xdist processes sharing the one GPU (none preallocates: tests/conftest.py);
                           # the tier is compile-bound on the host's 16 cores, and took over 137 s with 8


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  limit_s: float
  dry_limit_s: float


PARTS = (Part("env", 15, 60), Part("steps", 160, 160), Part("decode", 140, 120), Part("wire", 150, 150),
         Part("job", 200, 150), Part("unit", 180, 90), Part("sweep", 480, 360))
DEFAULT_PARTS = ("env", "steps", "decode", "wire")
SECOND_CALL_PARTS = ("env", "job", "unit")
SECOND_CALL_BUDGET_S = 410.0  # the second call, `--parts env,job,unit --budget-s 410`
SWEEP_CALL_PARTS = ("env", "sweep")
SWEEP_CALL_BUDGET_S = 505.0   # `make gpu-sweep`: `--parts env,sweep --budget-s 505`
BENCH_LIMIT_MARGIN_S = 5.0  # a benchmark part's own deadline ends this long before its SIGINT


@dataclasses.dataclass(frozen=True)
class Context:
  dry: bool
  work: str                  # per-part logs and outputs (tarred into --out at the end)
  python: str
  rl_steps: int

  def path(self, name: str) -> str:
    return os.path.join(self.work, name)


def part_command(name: str, ctx: Context) -> tuple[list[str], dict]:
  """The command of a part and the environment it adds."""
  py, quick = ctx.python, (["--quick"] if ctx.dry else [])
  if name == "env":
    return [py, "-m", "benchmarks.common.environment"], {}
  if name in ("steps", "decode", "wire", "sweep"):  # decode and wire share the device with torch (and wire with
    # a server process): JAX must not take 75%; steps and sweep run a process per step, one after another
    module = {"steps": "step", "decode": "decode", "wire": "wire", "sweep": "sweep"}[name]
    return [py, "-m", f"benchmarks.gpu.bench_gpu_{module}", "--json",
            ctx.path(f"{name}.json")] + quick, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  if name == "job":
    config = "configs/tiny.py" if ctx.dry else "configs/countdown.py"
    return [py, "-m", "vcpo_jax.main", f"--config={config}", f"--workdir={ctx.path('job')}",
            f"--config.rl.steps={ctx.rl_steps}", "--config.rl.max_lag=2", "--config.rollout.num_servers=1",
            "--config.eval_every=0", "--config.checkpoint_every=0"], {"VCPO_PROGRESS": "0"}
  if name == "unit":
    cmd = [py, "-m", "pytest", "-q", "-rfEs", "-m", "not slow and not integration", "-p", "no:cacheprovider",
           f"--junitxml={ctx.path('unit.xml')}"]
    cmd += list(DRY_TESTS) if ctx.dry else ["-n", str(GPU_TEST_WORKERS), "tests"]
    return cmd, {"VCPO_TEST_TIER": "unit"}
  raise ValueError(f"unknown part {name!r}; known: {[p.name for p in PARTS]}")


def base_env(ctx: Context, site: str | None) -> dict:
  """Every part's environment: the repo (and the carried wheels) importable, the chosen platform, the 0.5B
  shape (tiny when dry). The job and the tests place device memory themselves (launcher, conftest.py)."""
  path = [REPO_ROOT] + ([site] if site else []) + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
  env = dict(os.environ, PYTHONPATH=":".join(path), JAX_PLATFORMS="cpu" if ctx.dry else "cuda",
             BENCH_MODEL="tiny" if ctx.dry else "qwen2.5-0.5b", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1")
  if ctx.dry:  # one device, as on the GPU machine (not the test suite's 8 fake CPU devices); other flags kept
    from vcpo_jax.parallel import placement
    env["XLA_FLAGS"] = placement.xla_flags(env.get("XLA_FLAGS", ""))
  return env


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S):
  """SIGINT to the part's group, then its whole tree (servers in sessions of their own too) ended."""
  from vcpo_jax.rollout.servers import launcher
  pids = [proc.pid] + launcher.descendants(proc.pid)  # before the signal: orphans are not found afterwards
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGINT)
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.wait(timeout=grace_s)
  launcher.end_process_tree(proc, grace_s=3.0)
  for pid in pids:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.kill(pid, signal.SIGKILL)


def run_part(name: str, cmd: list[str], env: dict, limit_s: float, log_path: str) -> dict:
  """Runs one part with its output in log_path; SIGINT STOP_GRACE_S before the limit, killed at it."""
  start = time.monotonic()
  with open(log_path, "w") as log:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      rc, status = proc.wait(timeout=max(1.0, limit_s - STOP_GRACE_S)), None
    except subprocess.TimeoutExpired:
      stop(proc)
      rc, status = proc.returncode, "timed out"
  seconds = time.monotonic() - start
  status = status or ("ok" if rc == 0 else "failed")
  return {"part": name, "status": status, "returncode": rc, "seconds": round(seconds, 1),
          "limit_s": round(limit_s, 1), "log": os.path.basename(log_path)}


def install_wheels(wheels: str, log) -> str | None:
  """Installs the carried wheels (no index, no dependencies) into a folder of their own; returns it."""
  files = sorted(glob.glob(os.path.join(wheels, "*.whl")))
  if not files:
    log(f"no wheels in {wheels!r}: using the packages this Python already has")
    return None
  site = tempfile.mkdtemp(prefix="vcpo_gpu_site_")
  cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", site] + files
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  if proc.returncode != 0:
    raise RuntimeError(f"installing the wheels in {wheels} failed: {proc.stderr.strip()[-1500:]}")
  log(f"installed {len(files)} wheels into {site}: {', '.join(os.path.basename(f) for f in files)}")
  return site


def tail(path: str, n: int = 2500) -> str:
  try:
    with open(path, errors="replace") as f:
      text = f.read()
  except OSError:
    return ""
  return text if len(text) <= n else "..." + text[-n:]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dry", action="store_true", help="small shapes on the CPU (the same code path)")
  parser.add_argument("--out", default=None, help="output folder (default $OUT, else workdir/gpu_check[_dry])")
  parser.add_argument("--wheels", default=None,
                      help="folder of carried wheels to install first (default .gpu_wheels unless --dry)")
  parser.add_argument("--parts", default=None,
                      help=f"comma list, in order (default {','.join(DEFAULT_PARTS)}; dry: every part)")
  parser.add_argument("--budget-s", type=float, default=None,
                      help=f"wall-clock budget of the whole check (default {BUDGET_S:.0f}; dry {DRY_BUDGET_S:.0f})")
  parser.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                      help="a part's own time limit (repeatable), e.g. --limit unit=150")
  parser.add_argument("--rl-steps", type=int, default=None, help="RL steps of the job (default 20; dry 2)")
  args = parser.parse_args(argv)
  budget = args.budget_s or (DRY_BUDGET_S if args.dry else BUDGET_S)
  start = time.monotonic()
  out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(
      REPO_ROOT, "workdir", "gpu_check_dry" if args.dry else "gpu_check"))
  os.makedirs(out, exist_ok=True)
  work = tempfile.mkdtemp(prefix="vcpo_gpu_check_")
  log_lines: list[str] = []

  def log(line: str):
    line = f"[gpu_check {time.monotonic() - start:6.1f} s] {line}"
    print(line, flush=True)
    log_lines.append(line)
  known = {p.name: p for p in PARTS}
  parts_arg = args.parts or ",".join(p.name for p in PARTS if args.dry or p.name in DEFAULT_PARTS)
  names = [n.strip() for n in parts_arg.split(",") if n.strip()]
  if not names or any(n not in known for n in names):
    raise ValueError(f"--parts must name some of {list(known)}, got {args.parts!r}")
  limits = parse_limits(args.limit, known)
  wheels = args.wheels or (None if args.dry else os.path.join(REPO_ROOT, ".gpu_wheels"))
  site = None
  try:
    site = install_wheels(wheels, log) if wheels else None
  except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # the parts then say what is missing
    log(f"wheels not installed: {e}")
  if site:
    sys.path.insert(0, site)  # this process too imports the project (the report, ending process trees)
  ctx = Context(dry=args.dry, work=work, python=sys.executable,
                rl_steps=args.rl_steps or (2 if args.dry else 20))
  env = base_env(ctx, site)
  parts = []
  for name in names:
    part = known[name]
    left = budget - (time.monotonic() - start) - REPORT_RESERVE_S
    limit = min(limits.get(name, part.dry_limit_s if args.dry else part.limit_s), left)
    if limit < MIN_PART_S:
      parts.append({"part": name, "status": "skipped", "seconds": 0.0, "limit_s": round(max(limit, 0), 1),
                    "note": f"budget of {budget:.0f} s spent"})
      log(f"{name}: skipped (budget spent)")
      continue
    cmd, extra = part_command(name, ctx)
    log(f"{name}: limit {limit:.0f} s: {' '.join(cmd)}")
    result = run_part(name, cmd, {**env, **extra, "BENCH_JOB_LIMIT_S": str(bench_limit_s(limit))},
                      limit, ctx.path(f"{name}.log"))
    parts.append(result)
    log(f"{name}: {result['status']} (exit code {result['returncode']}) in {result['seconds']:.0f} s")
  from benchmarks.gpu import gpu_check_report as report
  results = report.collect(work, parts, dry=args.dry, command=command_line(argv), started=start)
  paths = report.write(results, work, out, copy_to_repo=not args.dry)
  for p in parts:
    log_lines.append(f"\n===== {p['part']}: {p['status']} ({p.get('log', '')}) =====\n"
                     + tail(ctx.path(f"{p['part']}.log")))
  shutil.rmtree(work, ignore_errors=True)  # all of it that is kept is in details.tar.gz
  if site:
    shutil.rmtree(site, ignore_errors=True)
  with open(os.path.join(out, "gpu_check.log"), "w") as f:
    f.write("\n".join(log_lines) + "\n")
  log(f"wrote {', '.join(paths)} and gpu_check.log in {out}")
  print(report.summary_lines(results), flush=True)
  return results


def bench_limit_s(part_limit_s: float) -> int:
  """The deadline a benchmark part gets for itself: before the part's SIGINT, with a margin to write its JSON."""
  return int(part_limit_s - STOP_GRACE_S - BENCH_LIMIT_MARGIN_S)


def parse_limits(items: list[str], known) -> dict[str, float]:
  """{part: seconds} from --limit PART=SECONDS items."""
  out = {}
  for item in items:
    name, _, value = item.partition("=")
    try:
      seconds = float(value)
    except ValueError:
      seconds = -1.0
    if name not in known or seconds <= 0:
      raise ValueError(f"--limit must be PART=SECONDS with PART in {list(known)} and SECONDS > 0, got {item!r}")
    out[name] = seconds
  return out


def command_line(argv) -> str:
  args = list(sys.argv[1:] if argv is None else argv)
  return " ".join(["python3 -m benchmarks.gpu.gpu_check"] + args)


if __name__ == "__main__":
  main()
