"""Parametrised ops whose backward also returns each sequence's squared gradient norm, through a zero 'tap'."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from vcpo_jax.learner import op_norms

# Shape letters: B batch, T length, I/O dense in/out, D hidden.
# Each op takes a float32 zero tap_B and returns its usual output. Its VJP gives the usual cotangents and,
# as the tap's cotangent, ||per-sequence parameter gradient||^2 of every row, formed from the op's input a
# and output-gradient g right where the backward reaches the op (under nn.scan: inside the scanned
# backward's body, one layer at a time). So the norms cost no stored stack of per-layer a/g: only the [B]
# cotangents of the taps leave the layer. An unused cotangent (the taps' in an ordinary backward, the
# parameters' in the norms pass) is dead code that XLA removes.
_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul(x_BxTxI, w_IxO, tap_B, mode: str, precision):
  del tap_B
  return jnp.einsum("bti,io->bto", x_BxTxI, w_IxO, preferred_element_type=_F32, precision=precision)


def _matmul_fwd(x_BxTxI, w_IxO, tap_B, mode, precision):
  return _matmul(x_BxTxI, w_IxO, tap_B, mode, precision), (x_BxTxI, w_IxO)


def _matmul_bwd(mode, precision, res, g_BxTxO):
  x_BxTxI, w_IxO = res
  g_BxTxO = g_BxTxO.astype(x_BxTxI.dtype)  # the compute dtype, as an ordinary backward of the cast output
  dx = jnp.einsum("bto,io->bti", g_BxTxO, w_IxO, preferred_element_type=_F32, precision=precision)
  dw = jnp.einsum("bti,bto->io", x_BxTxI, g_BxTxO, preferred_element_type=_F32, precision=precision)
  return dx.astype(x_BxTxI.dtype), dw.astype(w_IxO.dtype), op_norms.dense_sq_norms(x_BxTxI, g_BxTxO, mode)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.custom_vjp
def _bias_tap(y_BxTxO, tap_B):
  del tap_B
  return y_BxTxO


def _bias_tap_fwd(y_BxTxO, tap_B):
  del tap_B
  return y_BxTxO, None


def _bias_tap_bwd(res, g_BxTxO):
  del res
  return g_BxTxO, op_norms.bias_sq_norms(g_BxTxO)


_bias_tap.defvjp(_bias_tap_fwd, _bias_tap_bwd)


@jax.custom_vjp
def _scale(xhat_BxTxD, scale_D, tap_B):
  del tap_B
  return xhat_BxTxD * scale_D[None, None, :]


def _scale_fwd(xhat_BxTxD, scale_D, tap_B):
  return _scale(xhat_BxTxD, scale_D, tap_B), (xhat_BxTxD, scale_D)


def _scale_bwd(res, g_BxTxD):
  xhat_BxTxD, scale_D = res
  dscale_D = jnp.einsum("btd,btd->d", xhat_BxTxD, g_BxTxD, preferred_element_type=_F32)
  return (g_BxTxD * scale_D[None, None, :], dscale_D.astype(scale_D.dtype),
          op_norms.scale_sq_norms(xhat_BxTxD, g_BxTxD))


_scale.defvjp(_scale_fwd, _scale_bwd)


@dataclasses.dataclass(frozen=True)
class Taps:
  """The model's `capture` value for the bounded norms pass (model.transformer calls these three ops).

  mode: grad_norms mode of the dense rule ('auto' picks ghost or explicit per layer from its shape).
  adapter_only: only the adapters' ops (lora_A, lora_B) take taps: the frozen base's have no gradient."""
  mode: str = "auto"
  adapter_only: bool = False

  def dense(self, x_BxTxI, w_IxO, tap_B, precision):
    """x @ w in float32 (preferred element type), as model.transformer.Dense computes it."""
    return _matmul(x_BxTxI, w_IxO, tap_B, self.mode, precision)

  def bias(self, y_BxTxO, tap_B):
    return _bias_tap(y_BxTxO, tap_B)

  def scale(self, xhat_BxTxD, scale_D, tap_B):
    return _scale(xhat_BxTxD, scale_D, tap_B)
