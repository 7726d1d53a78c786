"""RLBatch: the one type that crosses from rollout to learner (right-padded rows, per-token and per-row fields)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax


@flax.struct.dataclass
class RLBatch:
  """B right-padded rows [prompt | response | pad]; mask_BxT is 1 exactly on generated tokens."""
  tokens_BxT: jax.Array
  mask_BxT: jax.Array
  sampler_logp_BxT: jax.Array
  rewards_B: jax.Array
  group_B: jax.Array
  lag_B: jax.Array
  valid_B: Optional[jax.Array] = None          # 0 on padding rows (excluded everywhere)
  prox_logp_BxT: Optional[jax.Array] = None    # decoupled-PPO proximal policy (losses default to sg(pi))
  ref_logp_BxT: Optional[jax.Array] = None     # reference policy for the k3 KL term (else computed in the step)
  version_BxT: Optional[jax.Array] = None      # int32 policy version that sampled each token, -1 off the mask
                                               # (book-keeping for metrics; not used by the loss)


def check_batch(batch: RLBatch):
  """Host-side shape check with errors naming the field."""
  if getattr(batch.tokens_BxT, "ndim", 0) != 2:
    raise ValueError(f"RLBatch.tokens_BxT must be 2-D [B, T], got shape {getattr(batch.tokens_BxT, 'shape', None)}")
  b, t = batch.tokens_BxT.shape
  for field in dataclasses.fields(batch):
    value = getattr(batch, field.name)
    if value is None:
      continue
    want = (b, t) if field.name.endswith("BxT") else (b,)
    if tuple(value.shape) != want:
      raise ValueError(f"RLBatch.{field.name} must have shape {want}, got {tuple(value.shape)}")
