"""Per-row sampling fields, defined once: a row's settings (defaults SGLang's) and their per-row arrays."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingFields:
  """How one row is sampled. The sampler's RowSpec and the wire's SamplingParams extend it; a new sampling
  parameter is a field here, a column in RowArrays and `row_arrays`, and its use in decode_kernels.draw."""
  max_new_tokens: int = 128
  temperature: float = 1.0  # at or below decode_kernels.GREEDY_TEMPERATURE: greedy
  top_p: float = 1.0
  top_k: int = -1  # -1: no top-k
  min_p: float = 0.0
  min_new_tokens: int = 0  # stop ids cannot be drawn before this many tokens
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False


def field_values(fields: SamplingFields) -> dict:
  """The SamplingFields part of any extension of it (a wire request's parameters -> a sampler row)."""
  return {f.name: getattr(fields, f.name) for f in dataclasses.fields(SamplingFields)}


class RowArrays(NamedTuple):
  """The per-row fields as arrays of B rows: what decode_kernels.draw reads for each row."""
  temperature_B: jax.Array
  top_p_B: jax.Array
  top_k_B: jax.Array  # V when disabled
  min_p_B: jax.Array
  min_new_B: jax.Array
  max_new_B: jax.Array
  ignore_eos_B: jax.Array
  stop_ids_BxK: jax.Array  # padded with V (never a token)
  key_data_Bx2: jax.Array  # each row's random stream, set on device from its (seed, stream)
  sample_offset_B: jax.Array  # tokens the row made before (a resumed row): advances its stream


def row_arrays(rows: Sequence, B: int, K: int, V: int) -> tuple[RowArrays, np.ndarray]:
  """Numpy arrays of `rows` (sampling.RowSpec) then free rows up to B (no new tokens), and (seed, stream)s."""
  free = B - len(rows)

  def col(fn, dtype, filler):
    return np.array([fn(r) for r in rows] + [filler] * free, dtype)

  stop_ids_BxK = np.full((B, K), V, np.int32)
  for b, r in enumerate(rows):
    stop_ids_BxK[b, :len(r.stop_token_ids)] = r.stop_token_ids
  arrays = RowArrays(
      temperature_B=col(lambda r: r.temperature, np.float32, 0.0),
      top_p_B=col(lambda r: r.top_p, np.float32, 1.0),
      top_k_B=col(lambda r: V if r.top_k <= 0 else min(r.top_k, V), np.int32, V),
      min_p_B=col(lambda r: r.min_p, np.float32, 0.0),
      min_new_B=col(lambda r: r.min_new_tokens, np.int32, 0),
      max_new_B=col(lambda r: r.max_new_tokens, np.int32, 0),
      ignore_eos_B=col(lambda r: r.ignore_eos, bool, True),
      stop_ids_BxK=stop_ids_BxK,
      key_data_Bx2=np.zeros((B, 2), np.uint32),
      sample_offset_B=col(lambda r: r.sample_offset, np.int32, 0))
  seeds_Bx2 = np.array([[r.seed % 2**32, r.stream % 2**32] for r in rows] + [[0, 0]] * free, np.uint32)
  return arrays, seeds_Bx2
