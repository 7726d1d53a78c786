"""The one place the learner's batch is built: a backend's scored groups -> right-padded rows on every process."""
from __future__ import annotations

import asyncio
import dataclasses
import io
from typing import Any, Optional, Sequence

import jax
import numpy as np

from vcpo_jax.learner.batch import RLBatch
from vcpo_jax.learner.config import check_chunks
from vcpo_jax.parallel import processes, sharding
from vcpo_jax.rollout import overlong
from vcpo_jax.rollout.backend import RolloutBackend
from vcpo_jax.rollout.types import Group, output_mask


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How a step's rows are laid out: fixed per job (RLRun.layout)."""
  seq_len: int
  pad_id: int
  num_rows: int  # rows per step: the samples, then invalid padding rows up to a multiple of the row shards
  vocab_size: Optional[int] = None
  mesh: Any = None  # several processes: rows are fed to the processes whose devices hold them
  micro_batch_size: int = 0
  timeout_s: float = 1800.0  # a follower's longest wait for its rows
  shaping: Optional[overlong.Shaping] = None  # rl.overlong: length penalty, truncated rows out of the loss


async def next_batch(backend: RolloutBackend, version: int, layout: BatchLayout) -> tuple[list[Group], RLBatch]:
  """The groups learner version `version` trains on and its RLBatch: host numpy rows with one process; with
  several, global arrays sharded like the step expects, each process fed its own rows (the leader's backend
  yields the groups, a follower's none: it waits for its rows from the leader)."""
  groups = await backend.next_groups(version)
  rows = None
  if processes.is_leader():  # with one process, the leader
    rows = groups_to_batch(groups, seq_len=layout.seq_len, pad_id=layout.pad_id, num_rows=layout.num_rows,
                           vocab_size=layout.vocab_size, shaping=layout.shaping)
  if not processes.multi_process():
    return groups, rows
  if rows is not None:
    # The step's own check cannot read rows held by other processes: the leader checks the host rows.
    check_chunks(rows, layout.micro_batch_size, layout.mesh.shape["data"] * layout.mesh.shape["fsdp"])
  # In a worker thread: an asynchronous backend keeps generating while the processes exchange rows.
  return groups, await asyncio.to_thread(feed_rows, rows, version, layout.mesh, layout.num_rows, layout.timeout_s)


def _check_sample(g: Group, ids: np.ndarray, logprobs, mask: np.ndarray, seq_len: int,
                  vocab_size: int | None) -> None:
  if ids.size > seq_len:
    raise ValueError(f"sample of group {g.index} has {ids.size} tokens, more than seq_len={seq_len}")
  if vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
    raise ValueError(f"group {g.index}: token id {bad} outside the vocabulary [0, {vocab_size})")
  if not np.all(np.isfinite(np.asarray(logprobs, np.float64)[mask > 0])):
    raise ValueError(f"group {g.index}: non-finite sampler log-prob in output_logprobs")


def groups_to_batch(groups: Sequence[Group], *, seq_len: int, pad_id: int, num_rows: int | None = None,
                    vocab_size: int | None = None, shaping: Optional[overlong.Shaping] = None) -> RLBatch:
  """One row per sample, [prompt | response | pad], the mask 1 on generated tokens only (an episode's
  tool outputs inside the response are 0); rows beyond the real samples (to fill `num_rows`) are
  invalid padding rows. Groups must be consumed (.sample_lags) and scored (.rewards). Token ids outside
  [0, vocab_size) and non-finite sampler log-probs are rejected here: inside jit they would be clamped or
  poison the whole batch silently. `shaping` (rl.overlong) adds the length penalty to the rewards (the
  groups' own .rewards, the verifier's outcome, are left as they are) and empties the mask of truncated rows."""
  for g in groups:
    if g.rewards is None or len(g.rewards) != len(g.samples):
      raise ValueError(f"group {g.index} is not scored: backends score each group with the job's Rewarder as it completes")
    if len(g.sample_lags) != len(g.samples):
      raise ValueError(f"group {g.index} has {len(g.sample_lags)} sample_lags for {len(g.samples)} samples")
  rows = [(gi, g, j) for gi, g in enumerate(groups) for j in range(len(g.samples))]
  B = num_rows or len(rows)
  if len(rows) > B:
    raise ValueError(f"batch has {len(rows)} samples but num_rows={B}")
  tokens = np.full((B, seq_len), pad_id, np.int32)
  mask = np.zeros((B, seq_len), np.float32)
  logp = np.zeros((B, seq_len), np.float32)
  version = np.full((B, seq_len), -1, np.int32)
  rewards, lag, valid = np.zeros((B,), np.float32), np.zeros((B,), np.float32), np.zeros((B,), np.float32)
  group = np.full((B,), -1, np.int32)
  for row, (gi, g, j) in enumerate(rows):
    s = g.samples[j]
    ids = np.asarray(list(s.prompt_ids) + list(s.output_ids), np.int64)
    start, end = len(s.prompt_ids), ids.size
    out_mask = output_mask(g, s, end - start)
    _check_sample(g, ids, s.output_logprobs, out_mask, seq_len, vocab_size)
    tokens[row, :end] = ids
    mask[row, start:end] = out_mask
    # Tool-output tokens (mask 0) carry no sampler log-prob and no version, whatever the sample holds there.
    logp[row, start:end] = np.where(out_mask > 0, np.asarray(s.output_logprobs, np.float32), 0.0)
    version[row, start:end] = np.where(out_mask > 0, np.asarray(s.token_versions, np.int32), -1)
    rewards[row], group[row], lag[row], valid[row] = g.rewards[j], gi, g.sample_lags[j], 1.0
    if shaping is not None and shaping.penalty:
      rewards[row] += np.float32(overlong.length_penalty([out_mask.sum()], shaping.max_length,
                                                         shaping.cache_length)[0])
    if shaping is not None and shaping.mask_truncated and overlong.truncated(s):
      mask[row] = 0.0  # still valid: its reward counts in the group's baseline and std
  # Padding rows get their own group ids so no group statistic mixes them with real samples.
  pad_rows = np.arange(len(rows), B)
  group[pad_rows] = len(groups) + np.arange(len(pad_rows))
  return RLBatch(tokens_BxT=tokens, mask_BxT=mask, sampler_logp_BxT=logp, rewards_B=rewards, group_B=group,
                 lag_B=lag, valid_B=valid, version_BxT=version)


# ------------------------------------------------------------------------------------ rows per process
def process_rows(mesh, num_rows: int) -> dict[int, tuple[int, int]]:
  """process index -> [start, stop) of the batch rows its devices hold under the step's row sharding."""
  spans: dict[int, set] = {}
  for device, index in sharding.batch_sharding(mesh, 1).devices_indices_map((num_rows,)).items():
    spans.setdefault(device.process_index, set()).update(range(*index[0].indices(num_rows)))
  out = {}
  for p, rows in spans.items():
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
      raise ValueError(f"the mesh gives process {p} non-contiguous batch rows; order the mesh's devices by "
                       "process (sharding.make_mesh does)")
    out[p] = (lo, hi)
  return out


def _pack(batch: RLBatch) -> bytes:
  buf = io.BytesIO()
  np.savez(buf, **{f.name: np.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                   if getattr(batch, f.name) is not None})
  return buf.getvalue()


def _unpack(data: bytes) -> RLBatch:
  with np.load(io.BytesIO(data)) as z:
    return RLBatch(**{k: z[k] for k in z.files})


def _slice(batch: RLBatch, lo: int, hi: int) -> RLBatch:
  return jax.tree.map(lambda x: np.asarray(x)[lo:hi], batch)


def feed_rows(batch: Optional[RLBatch], step: int, mesh, num_rows: int, timeout_s: float) -> RLBatch:
  """The step's batch as global arrays sharded like the step expects (rows over data x fsdp), each process
  feeding only its own rows. The leader passes the whole host batch and sends each follower its rows; a
  follower passes None and waits (at most timeout_s) for them. Single process: the batch unchanged."""
  if not processes.multi_process():
    return batch
  spans, me = process_rows(mesh, num_rows), jax.process_index()
  if processes.is_leader():
    for p, (lo, hi) in spans.items():
      if p != me:
        processes.kv_set(f"rows/{step}/{p}", _pack(_slice(batch, lo, hi)))
    local = _slice(batch, *spans[me])
  else:
    local = _unpack(processes.kv_get(f"rows/{step}/{me}", timeout_s, f"the leader's batch for step {step}"))
  processes.barrier(f"step/{step}", timeout_s)  # everyone is here before the step's collectives start
  if processes.is_leader():  # every follower has read its rows (it is past the barrier)
    for p in spans:
      if p != me:
        processes.kv_delete(f"rows/{step}/{p}")

  def to_global(x):
    return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, x.ndim), x,
                                                  (num_rows,) + x.shape[1:])
  return jax.tree.map(to_global, local)
