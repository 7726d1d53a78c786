"""The torch process group weights travel in, set up as SGLang's servers set up their side, with deadlines.

SGLang's `/init_weights_update_group` joins a non-default group through a TCP rendezvous on
`tcp://master_address:master_port`, a `PrefixStore(group_name, store)` and torch's process-group helper; a
sender built with plain `init_process_group` waits on other store keys and hangs. Both ends here (the learner
as rank 0, the embedded server as a receiver) build the group the same way, with an explicit timeout: SGLang's
own is torch's 30 minutes, so the learner enforces the deadlines. torch is imported only on this path.
"""
from __future__ import annotations

import datetime
import socket
from typing import Any

INSTALL_HINT = ("rollout.publish=wire needs torch (the process group weights travel in): "
                "pip install torch (on a CPU machine: pip install torch --index-url "
                "https://download.pytorch.org/whl/cpu; on GPUs the same torch version the SGLang servers run)")


def require_torch():
  """torch, or an ImportError that says how to install it."""
  try:
    import torch
    import torch.distributed  # noqa: F401
  except ImportError as e:
    raise ImportError(f"{INSTALL_HINT} ({e})") from e
  return torch


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def join(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
         timeout_s: float) -> Any:
  """Creates (rank 0: hosts the store) or joins the group; blocks until all world_size ranks arrive or
  timeout_s passes (then raises)."""
  torch = require_torch()
  from torch.distributed import distributed_c10d as c10d
  if not group_name:
    raise ValueError("group_name must be a non-empty string")
  timeout = datetime.timedelta(seconds=timeout_s)
  store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                 timeout=timeout))
  store.set_timeout(timeout)
  store = c10d.PrefixStore(group_name, store)
  options = "backend_options" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6) else "pg_options"
  pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                         group_name=group_name, timeout=timeout, **{options: None})
  c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
  return pg


def broadcast(pg: Any, tensor: Any, timeout_s: float) -> None:
  """broadcast(src=0) on pg; raises (RuntimeError from torch) when it does not complete within timeout_s."""
  torch = require_torch()
  work = torch.distributed.broadcast(tensor, src=0, group=pg, async_op=True)
  if not work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
    raise TimeoutError(f"the broadcast did not complete within {timeout_s} s")


def destroy(pg: Any) -> None:
  """Tears the group down (a peer that died leaves nothing to wait for: errors are ignored)."""
  torch = require_torch()
  try:
    torch.distributed.destroy_process_group(pg)
  except Exception:  # noqa: BLE001 -- the group may already be broken; nothing else holds it
    pass
