"""A throwaway Slurm cluster on this machine for tests: munged, slurmctld and one slurmd per node name."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "srun")
PACKAGES = ("slurm-wlm", "munge")  # Debian's: slurmctld, slurmd, the client commands, munge


def missing() -> str:
  """Why a cluster cannot start here ('' when it can): not root, or the Slurm / munge commands absent."""
  if os.geteuid() != 0:
    return "needs root (slurmd starts each job step as its user)"
  absent = [c for c in DAEMONS + CLIENTS + ("munge",) if not shutil.which(c)]
  if absent:
    return f"Slurm is not installed ({', '.join(absent)} missing: apt-get install -y {' '.join(PACKAGES)})"
  if len(node_names()) < 2:
    return "fewer than two host names resolve to this machine's loopback address (/etc/hosts)"
  return ""


def install() -> None:
  """Debian's packages, where the machine lets root install them (make test-slurm asks for this)."""
  if os.geteuid() == 0 and shutil.which("apt-get") and not shutil.which("slurmctld"):
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=env, capture_output=True, timeout=600)


def node_names() -> list[str]:
  """Two names of this machine that resolve to loopback: each node's name is also where its servers listen."""
  names = []
  for name in dict.fromkeys([socket.gethostname(), "localhost"]):
    with contextlib.suppress(OSError):
      if socket.gethostbyname(name).startswith("127."):
        names.append(name)
  return names[:2]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def slurm_conf(base: str, nodes: list[str], munge_socket: str) -> str:
  """One partition of `nodes`, each shrunk to 1 CPU and no GPU; no cgroups, no accounting, state under base."""
  ports = [free_port() for _ in range(len(nodes) + 1)]
  lines = [
      "ClusterName=vcpotest", f"SlurmctldHost={nodes[0]}(127.0.0.1)", f"SlurmctldPort={ports[0]}",
      "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
      f"AuthInfo=socket={munge_socket}", f"StateSaveLocation={base}/state", f"SlurmdSpoolDir={base}/spool/%n",
      f"SlurmctldPidFile={base}/slurmctld.pid", f"SlurmdPidFile={base}/slurmd.%n.pid",
      f"SlurmctldLogFile={base}/slurmctld.log", f"SlurmdLogFile={base}/slurmd.%n.log",
      "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
      "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill",
      "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
      "ReturnToService=2", "SlurmdParameters=config_overrides", "KillWait=5", "InactiveLimit=0",
      "SlurmctldTimeout=30", "SlurmdTimeout=30", "MessageTimeout=20",
  ]
  lines += [f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} Port={p} CPUs=1 State=UNKNOWN"
            for n, p in zip(nodes, ports[1:])]
  lines.append(f"PartitionName=test Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
  path = os.path.join(base, "slurm.conf")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


class Cluster:
  """Started by `start`, stopped by `stop` (every daemon and any job process left behind)."""

  def __init__(self, base: str):
    self.base = os.path.abspath(base)
    self.nodes = node_names()
    self.env = dict(os.environ)
    self.daemons: list[subprocess.Popen] = []

  def _daemon(self, argv: list[str], name: str) -> None:
    log = open(os.path.join(self.base, f"{name}.out"), "w")
    self.daemons.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True))

  def start(self, timeout_s: float = 60.0) -> "Cluster":
    for d in ("munge", "state", *(os.path.join("spool", n) for n in self.nodes)):
      os.makedirs(os.path.join(self.base, d), mode=0o700, exist_ok=True)
    os.chmod(self.base, 0o755)  # munged refuses a socket directory others may write
    key = os.path.join(self.base, "munge", "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = os.path.join(self.base, "munge", "munge.socket")
    self._daemon(["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                  f"--pid-file={self.base}/munge/munged.pid", f"--log-file={self.base}/munge/munged.log",
                  f"--seed-file={self.base}/munge/munged.seed"], "munged")
    self._wait(lambda: os.path.exists(sock), timeout_s, "munged's socket")
    self.env["SLURM_CONF"] = slurm_conf(self.base, self.nodes, sock)
    self._daemon(["slurmctld", "-D", "-i"], "slurmctld")
    for n in self.nodes:
      self._daemon(["slurmd", "-D", "-N", n], f"slurmd.{n}")
    self._wait(self._nodes_idle, timeout_s, "both nodes idle (sinfo)")
    return self

  def _nodes_idle(self) -> bool:
    out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
    return sum(state == "idle" for state in out[1::2]) == len(self.nodes)

  def _wait(self, ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
      dead = [p.args[0] for p in self.daemons if p.poll() is not None]
      if dead or time.monotonic() > deadline:
        raise RuntimeError(f"slurm_cluster: {what} not ready ({'exited: ' + ', '.join(dead) if dead else 'timeout'})"
                           f"; logs in {self.base}:\n{self.logs()}")
      time.sleep(0.5)

  def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=60, **kw)

  def wait_job(self, job_id: str, timeout_s: float) -> str:
    """The job's final state (COMPLETED, FAILED, ...); raises on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
      states = {kv.split("=", 1)[1] for line in out.splitlines() for kv in line.split()
                if kv.startswith("JobState=")}
      if states and not states & {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"}:
        return ",".join(sorted(states))
      time.sleep(1.0)
    raise TimeoutError(f"job {job_id} still running after {timeout_s:g}s:\n{out}")

  def logs(self) -> str:
    parts = []
    for name in sorted(os.listdir(self.base)):
      if name.endswith((".log", ".out")):
        with open(os.path.join(self.base, name), errors="replace") as f:
          parts.append(f"== {name}\n" + "".join(f.readlines()[-30:]))
    return "\n".join(parts)

  def stop(self) -> None:
    """Cancels any job and waits for its steps to end, then ends each daemon's session."""
    if "SLURM_CONF" in self.env:
      with contextlib.suppress(Exception):
        self.run(["scancel", "--partition=test"], check=False)
        deadline = time.monotonic() + 30
        while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
          time.sleep(0.5)
    for p in reversed(self.daemons):
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    for p in reversed(self.daemons):
      try:
        p.wait(timeout=20)
      except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


@contextlib.contextmanager
def cluster(base: str):
  c = Cluster(base)
  try:
    yield c.start()
  finally:
    c.stop()
