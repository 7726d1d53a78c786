"""One rollout server of a fleet: waits for its starting weights, records where it runs, becomes the server.

    python -m experiments.launch.fleet_server --engine=embedded|sglang --name=server0 --model_dir=W/base \
        [--ready_file=W/base/warm_start.json] --port=P [--host=0.0.0.0] [--weights_root=W/weights] \
        [--info_dir=W/fleet] [--wait_s=3600] [-- extra server flags]

It is started with the learner, whose warm start (WORKDIR/base) may not exist yet: it waits for
`ready_file` (or MODEL_DIR/config.json), then replaces itself (exec, same pid) by the embedded server
(`python -m vcpo_jax.serving.server`) or real SGLang (third_party/launch_sglang.sh; PYTHON= names the
interpreter that has sglang). So the engine's stop signal reaches the server itself. `info_dir/NAME.json`
records the pid, host and url (for operators and tests; the learner gets the urls from its flags).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from vcpo_jax.rollout.servers import launcher

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--engine", choices=("embedded", "sglang"), default="embedded")
  p.add_argument("--name", default="server")
  p.add_argument("--model_dir", required=True, help="the starting weights (a Hugging Face directory)")
  p.add_argument("--ready_file", default="", help="wait for this file (default: MODEL_DIR/config.json)")
  p.add_argument("--host", default="127.0.0.1", help="bind address")
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--weights_root", default="", help="embedded: where weight updates may be read from")
  p.add_argument("--info_dir", default="")
  p.add_argument("--wait_s", type=float, default=3600.0, help="give up waiting for the weights after this")
  argv = list(argv)
  extra = argv[argv.index("--") + 1:] if "--" in argv else []
  return p.parse_args(argv[:argv.index("--")] if "--" in argv else argv), extra


def wait_for(path: str, timeout_s: float, poll_s: float = 1.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise SystemExit(f"fleet_server: {path} did not appear within {timeout_s:g}s (--wait_s): the learner's "
                       "warm start never finished, or this host cannot see its workdir")
    time.sleep(poll_s)


def server_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
  """The engine's own command line for this server."""
  if args.engine == "sglang":
    return ["bash", os.path.join(REPO, "third_party", "launch_sglang.sh"), args.model_dir, str(args.port),
            "--", *extra]
  cmd = [sys.executable, "-m", "vcpo_jax.serving.server", "--model-path", args.model_dir, "--host", args.host,
         "--port", str(args.port), "--weight-version", "v0"]
  if args.weights_root:
    cmd += ["--weights-root", args.weights_root]
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # shared, as the job's embedded servers share it
    cmd += ["--compilation-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
  return cmd + extra


def server_env(args: argparse.Namespace) -> dict[str, str]:
  """The environment every server the package starts gets (launcher.server_environ: one device, no up-front
  grab of a GPU it may share with a learner), plus real SGLang's bind address and first version."""
  return launcher.server_environ(os.environ, {"HOST": args.host, "WEIGHT_VERSION": "v0"}
                                 if args.engine == "sglang" else {})


def write_info(args: argparse.Namespace) -> None:
  if not args.info_dir:
    return
  os.makedirs(args.info_dir, exist_ok=True)
  host = socket.gethostname()
  info = {"name": args.name, "pid": os.getpid(), "host": host, "engine": args.engine,
          "url": f"http://{args.host if args.host != '0.0.0.0' else host}:{args.port}"}
  path = os.path.join(args.info_dir, f"{args.name}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(info, f)
  os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> None:
  args, extra = parse(sys.argv[1:] if argv is None else argv)
  wait_for(args.ready_file or os.path.join(args.model_dir, "config.json"), args.wait_s)
  cmd = server_command(args, extra)
  write_info(args)
  print(f"fleet_server {args.name}: {' '.join(cmd)}", flush=True)
  os.execvpe(cmd[0], cmd, server_env(args))


if __name__ == "__main__":
  main()
