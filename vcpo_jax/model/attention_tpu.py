"""TPU flash attention: jax's splash attention Pallas kernel, with the model's boolean mask as a dynamic mask."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from vcpo_jax.parallel import target

# Shape letters as in attention.py: B batch, T query length, S key length, H query heads, K kv heads, E head dim.
BLOCKS = (512, 256, 128)   # q / kv tile sizes tried, largest first; a tile must divide the length
LANES = 128                # TPU vector lanes: tiles are multiples of it
_warned: set = set()


def block_size(length: int) -> int | None:
  return next((b for b in BLOCKS if length % b == 0), None)


def unsupported(q_BxTxHxE, k_BxSxKxE) -> str | None:
  """Why the splash kernel cannot take these inputs (None when it can)."""
  if q_BxTxHxE.dtype not in (jnp.bfloat16, jnp.float32):
    return f"compute dtype {q_BxTxHxE.dtype} (splash attention takes bfloat16 or float32)"
  T, S = q_BxTxHxE.shape[1], k_BxSxKxE.shape[1]
  if block_size(T) is None or block_size(S) is None:
    return f"query/key length {T}/{S} (splash attention tiles them by multiples of {LANES})"
  if q_BxTxHxE.shape[2] % k_BxSxKxE.shape[2]:
    return f"{q_BxTxHxE.shape[2]} query heads over {k_BxSxKxE.shape[2]} kv heads"
  return None


def chosen(implementation: str, q_BxTxHxE, k_BxSxKxE) -> bool:
  """Whether model.attention=`implementation` runs the splash kernel here: "auto" on a TPU target, "splash"
  anywhere, where the inputs allow it (else the XLA path; "splash" says why once)."""
  if implementation != "splash" and not (implementation == "auto" and target.current().platform == "tpu"):
    return False
  why = unsupported(q_BxTxHxE, k_BxSxKxE)
  if why and implementation == "splash" and why not in _warned:
    _warned.add(why)
    logging.warning("model.attention='splash' unsupported (%s): using the XLA path", why)
  return why is None


def _kernel(mask_HxTxS, T: int, S: int, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  bq, bkv = block_size(T), block_size(S)
  blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                             block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
  # A jax.Array mask is a dynamic mask: any pattern, fully masked tiles skipped at run time.
  kernel = splash.make_splash_mha(mask_HxTxS, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
  # make_splash_mha turns every mask-info field into an array, the flag its __call__ branches on in Python too
  # (a tracer under jit): it is a dynamic mask, known here.
  kernel.fwd_mask_info = kernel.fwd_mask_info._replace(is_dynamic_mask=True)
  return kernel


def splash_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, dtype, *, interpret: bool = False):
  """Softmax(q k^T / sqrt(E)) v by the splash kernel (float32 softmax statistics inside); a fully masked query
  row gets the mean of v, as the einsum reference path gives it. `interpret` runs the kernel in Pallas'
  interpreter (any backend: the CPU tests). Under a mesh each device runs it on its own rows and heads (XLA
  cannot partition a Mosaic kernel)."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return _local(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, dtype, interpret)
  shape = dict(mesh.shape)
  rows = tuple(a for a in ("data", "fsdp") if shape.get(a, 1) > 1)
  n = 1
  for a in rows:
    n *= shape[a]
  tensor = shape.get("tensor", 1)
  batch = rows if rows and q_BxTxHxE.shape[0] % n == 0 else None  # e.g. remat's per-device estimate: replicated
  heads = "tensor" if tensor > 1 and k_BxSxKxE.shape[2] % tensor == 0 else None
  spec = P(batch, None, heads, None)
  return jax.shard_map(lambda q, k, v, m: _local(q, k, v, m, dtype, interpret), mesh=mesh,
                       in_specs=(spec, spec, spec, P(batch, None, None)), out_specs=spec, check_vma=False)(
                           q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS)


def _local(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, dtype, interpret: bool):
  B, T, H, E = q_BxTxHxE.shape
  S = k_BxSxKxE.shape[1]
  q_BxHxTxE = (q_BxTxHxE * jnp.asarray(1.0 / float(E) ** 0.5, q_BxTxHxE.dtype)).transpose(0, 2, 1, 3)
  k_BxKxSxE, v_BxKxSxE = k_BxSxKxE.transpose(0, 2, 1, 3), v_BxSxKxE.transpose(0, 2, 1, 3)

  def one(q_HxTxE, k_KxSxE, v_KxSxE, mask_TxS):
    kernel = _kernel(jnp.broadcast_to(mask_TxS.astype(jnp.bool_)[None], (H, T, S)), T, S, interpret)
    return kernel(q_HxTxE, k_KxSxE, v_KxSxE)
  out_BxTxHxE = jax.vmap(one)(q_BxHxTxE, k_BxKxSxE, v_BxKxSxE, mask_BxTxS).transpose(0, 2, 1, 3)
  seen_BxT = jnp.any(mask_BxTxS, axis=-1)
  mean_BxHxE = jnp.repeat(jnp.mean(v_BxSxKxE.astype(jnp.float32), axis=1), H // k_BxSxKxE.shape[2], axis=1)
  return jnp.where(seen_BxT[:, :, None, None], out_BxTxHxE.astype(jnp.float32),
                   mean_BxHxE[:, None]).astype(dtype)
