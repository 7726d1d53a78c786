"""A run's whole fleet as a list of processes: N learner processes and M rollout servers, wired by flags.

Pure planning, shared by the XManager (xm_fleet.py) and Slurm (slurm_fleet.py) launches; docs/multihost.md.
How the servers' addresses reach the learner: flags. The launch chooses every server's host and port before
anything starts (Local: free ports on this machine; Slurm: the rollout nodes' names and a fixed port) and
passes the list to the learner as rollout.server_urls, with rollout.min_servers. No rendezvous service, no
shared filesystem needed for it, nothing a server must write; a server that is late or restarts on its
address is found by the client's health checks.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys

from vcpo_jax.job import config_file
from vcpo_jax.parallel import placement
from vcpo_jax.rollout.servers import lora_launch

ENGINES = ("embedded", "sglang")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "")


class LayoutError(ValueError):
  """A layout the launch refuses to start, with why and what to do."""


@dataclasses.dataclass(frozen=True)
class Fleet:
  """Where everything runs. learner_hosts[i] runs JAX process i (process 0 drives the rollouts);
  server_hosts[j] and server_ports[j] are server j's address."""
  config: str
  workdir: str
  learner_hosts: tuple[str, ...]
  server_hosts: tuple[str, ...]
  server_ports: tuple[int, ...]
  coordinator_port: int
  engine: str = "embedded"
  min_servers: int = 0               # rollout.min_servers (0: all)
  devices_per_process: int = 0       # > 0: fake that many CPU devices per learner process (tests)
  shared_workdir: bool = False       # the workdir is on a filesystem every host sees
  publish: str = "disk"              # the config's rollout.publish
  server_model: str = ""             # "" = WORKDIR/base, the job's warm start, waited for
  server_flags: tuple[str, ...] = ()  # the engine's own launch flags (LoRA's: config_server_flags)
  extra: tuple[str, ...] = ()        # more vcpo_jax.main flags (--config.x=y)
  python: str = sys.executable


@dataclasses.dataclass(frozen=True)
class Process:
  name: str
  host: str
  argv: tuple[str, ...]
  env: dict


def is_local(host: str) -> bool:
  return host in LOCAL_HOSTS


def server_urls(fleet: Fleet) -> list[str]:
  return [f"http://{h or '127.0.0.1'}:{p}" for h, p in zip(fleet.server_hosts, fleet.server_ports)]


def check(fleet: Fleet) -> None:
  """Refuses what cannot work, naming the flag and what to do instead."""
  if not fleet.learner_hosts:
    raise LayoutError("the fleet needs at least one learner process")
  if not fleet.server_hosts or len(fleet.server_hosts) != len(fleet.server_ports):
    raise LayoutError(f"the fleet needs >= 1 server, one port each; got hosts {fleet.server_hosts}, "
                      f"ports {fleet.server_ports}")
  if fleet.engine not in ENGINES:
    raise LayoutError(f"engine={fleet.engine!r} must be one of {ENGINES}")
  if len(set(server_urls(fleet))) != len(fleet.server_hosts):
    raise LayoutError(f"two servers share an address: {server_urls(fleet)}")
  if not 0 <= fleet.min_servers <= len(fleet.server_hosts):
    raise LayoutError(f"min_servers={fleet.min_servers} must be in [0, {len(fleet.server_hosts)}] (the servers)")
  leader = fleet.learner_hosts[0]
  remote = sorted({h for h in fleet.server_hosts if h != leader and not (is_local(h) and is_local(leader))})
  if not remote or fleet.shared_workdir:
    return
  if fleet.publish != "wire":
    raise LayoutError(
        f"servers on {remote} run on other hosts than the learner's process 0 ({leader}), and with "
        f"rollout.publish={fleet.publish!r} every server loads each version from WORKDIR/weights "
        f"({fleet.workdir}/weights), which only the learner's host can be assumed to see. Either put the "
        "workdir on a filesystem every host mounts at the same path and say so (--shared_workdir; Slurm: "
        "SHARED_WORKDIR=1), or send the weights over the wire: --config.rollout.publish=wire.")
  if not fleet.server_model:
    raise LayoutError(
        f"servers on {remote} cannot read the learner's warm start ({fleet.workdir}/base) without a shared "
        "workdir: start them on a copy of the starting weights every server host has (--server_model=DIR, "
        "e.g. the model.hf_path checkpoint), or declare the workdir shared (--shared_workdir).")


def learner_args(fleet: Fleet, process_id: int) -> dict[str, str]:
  """vcpo_jax.main's flags for learner process `process_id` (strings: XManager's args dict)."""
  args = {"config": fleet.config, "workdir": fleet.workdir,
          "config.rollout.server_urls": ",".join(server_urls(fleet)),
          "config.rollout.min_servers": str(fleet.min_servers)}
  if len(fleet.learner_hosts) > 1:
    args.update({"config.distributed.num_processes": str(len(fleet.learner_hosts)),
                 "config.distributed.process_id": str(process_id),
                 "config.distributed.coordinator_address": f"{fleet.learner_hosts[0]}:{fleet.coordinator_port}"})
  for arg in fleet.extra:
    key, sep, value = arg.lstrip("-").partition("=")
    if not sep or not key.startswith("config."):
      raise LayoutError(f"extra learner flag {arg!r} must look like --config.<field>=<value>")
    args[key] = value
  return args


def server_args(fleet: Fleet, index: int) -> dict[str, str]:
  """experiments.launch.fleet_server's flags for server `index`."""
  host = fleet.server_hosts[index]
  model = fleet.server_model or os.path.join(fleet.workdir, "base")
  args = {"engine": fleet.engine, "name": f"server{index}", "model_dir": model,
          # The warm start's marker is written last: the directory is complete once it exists.
          "ready_file": os.path.join(model, "warm_start.json") if not fleet.server_model else "",
          "host": "127.0.0.1" if is_local(host) else "0.0.0.0", "port": str(fleet.server_ports[index]),
          "weights_root": os.path.join(fleet.workdir, "weights"),
          "info_dir": os.path.join(fleet.workdir, "fleet")}
  return {k: v for k, v in args.items() if v}


def learner_env(fleet: Fleet) -> dict[str, str]:
  d = fleet.devices_per_process
  return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": placement.xla_flags("", d)} if d > 0 else {}


def flag_list(args: dict[str, str]) -> list[str]:
  return [f"--{k}={v}" for k, v in args.items()]


def processes(fleet: Fleet) -> list[Process]:
  """Every process of the fleet, servers first (they wait for the learner's warm start anyway)."""
  check(fleet)
  engine_flags = ("--", *fleet.server_flags) if fleet.server_flags else ()
  out = [Process(f"server{j}", h, (fleet.python, "-m", "experiments.launch.fleet_server",
                                   *flag_list(server_args(fleet, j)), *engine_flags), {})
         for j, h in enumerate(fleet.server_hosts)]
  out += [Process(f"learner{i}", h, (fleet.python, "-m", "vcpo_jax.main", *flag_list(learner_args(fleet, i))),
                  learner_env(fleet))
          for i, h in enumerate(fleet.learner_hosts)]
  return out


def describe(procs: list[Process]) -> str:
  """The dry mode's text: one line per process, its host, environment and command."""
  return "\n".join(f"{p.name} @{p.host or 'localhost'}: " + " ".join(
      [*(f"{k}={v}" for k, v in p.env.items()), *p.argv]) for p in procs)


def config_publish(config: str, extra: tuple[str, ...] | list[str]) -> str:
  """The run's rollout.publish: a --config.rollout.publish flag, else the config file's (default "disk")."""
  for arg in extra:
    key, _, value = arg.lstrip("-").partition("=")
    if key == "config.rollout.publish":
      return value
  return load_config(config).rollout.get("publish", "disk")


def load_config(config: str):
  """The config file's get_config(variant), without flags."""
  path, _, variant = config.partition(":")
  if not os.path.isfile(path):
    raise LayoutError(f"--config file does not exist: {path!r}")
  module = config_file.load(path)
  return module.get_config(variant) if variant else module.get_config()


def config_server_flags(config: str, extra: tuple[str, ...] | list[str]) -> tuple[str, ...]:
  """The servers' launch flags the run needs: LoRA's when model.lora.rank > 0 (the config file's, then any
  --config.model.lora.* or --config.rl.max_lag flag)."""
  cfg = load_config(config)
  for arg in extra:
    key, _, value = arg.lstrip("-").partition("=")
    if key.startswith("config.model.lora.") or key == "config.rl.max_lag":
      *path, leaf = key.split(".")[1:]
      node = cfg
      for part in path:
        if part not in node:
          raise LayoutError(f"--{key}: the config {config!r} has no {part!r} section")
        node = node[part]
      node[leaf] = int(value) if value.lstrip("-").isdigit() else value
  return lora_launch.server_flags(lora_launch.from_config(cfg))


def expand_hostlist(spec: str) -> list[str]:
  """Slurm's compact node list ("r[01-03,7],l1") as names; one bracket group per name, as Slurm prints."""
  names = []
  for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", spec):
    m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
    if not m:
      names.append(part)
      continue
    prefix, ranges, suffix = m.groups()
    for r in ranges.split(","):
      lo, _, hi = r.partition("-")
      for n in range(int(lo), int(hi or lo) + 1):
        names.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
  return names
