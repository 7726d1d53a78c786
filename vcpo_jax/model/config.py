"""ModelConfig: sizes, dtypes, matmul precision, layers under scan, remat policy and attention of the model."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from vcpo_jax.model import attention as attention_lib

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Matmul precision by name. "default" lets the backend choose (TF32 for float32 on recent GPUs, one bf16 pass
# on TPU); "highest" is true float32 everywhere; on CPU all three are float32.
PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "high": jax.lax.Precision.HIGH,
              "default": jax.lax.Precision.DEFAULT}
# What one layer keeps for the backward pass (jax.checkpoint policy); "none" = no rematerialisation.
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.checkpoint_dots,
                  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
# "auto": the learner's steps pick the cheapest policy whose estimated memory fits (vcpo_jax.model.remat);
# a forward alone (sampler, evaluation) keeps nothing for a backward, so there it is "none".
REMAT_CHOICES = tuple(REMAT_POLICIES) + ("auto",)
LM_HEADS = ("vocab_chunks", "token_tiles", "plain")  # model.lm_head (see the field)
# The decoder's linear layers by their Hugging Face names: what model.lora.target_modules may name.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _from_dict(cls, d, what: str):
  """cls(**d) from a dict or ConfigDict; an unknown key is an error naming it and the known ones."""
  d = dict(d.to_dict() if hasattr(d, "to_dict") else d)
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - known)
  if unknown:
    raise ValueError(f"unknown {what} {unknown}; known keys: {sorted(known)}")
  return cls(**d)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the decoder's linear layers (vcpo_jax.model.lora; docs/lora.md). rank 0 = off.

  A layer with an adapter computes y = x W + (alpha / rank) (x A) B: scaling exactly alpha / rank (no
  rsLoRA), as PEFT and SGLang apply it."""
  rank: int = 0
  alpha: float = 32.0
  target_modules: tuple[str, ...] = LINEAR_MODULES

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
      raise ValueError(f"model.lora.rank must be an int >= 0 (0: off), got {self.rank!r}")
    if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
      raise ValueError(f"model.lora.alpha must be a number > 0, got {self.alpha!r}")
    targets = self.target_modules
    if isinstance(targets, str) or not isinstance(targets, (tuple, list)) or not targets:
      raise ValueError(f"model.lora.target_modules must be a non-empty list of {list(LINEAR_MODULES)}, "
                       f"got {targets!r}")
    for name in targets:
      if name not in LINEAR_MODULES:
        raise ValueError(f"model.lora.target_modules: the model has no linear layer {name!r} "
                         f"(its linear layers: {list(LINEAR_MODULES)})")
    if len(set(targets)) != len(targets):
      raise ValueError(f"model.lora.target_modules names a module twice: {list(targets)}")
    object.__setattr__(self, "target_modules", tuple(targets))  # hashable: ModelConfig is a static jit arg
    object.__setattr__(self, "alpha", float(self.alpha))

  @property
  def scale(self) -> float:
    """alpha / rank: the factor on (x A) B."""
    return self.alpha / self.rank if self.rank else 0.0

  @classmethod
  def from_dict(cls, d) -> "LoraConfig":
    if isinstance(d, LoraConfig):
      return d
    return _from_dict(cls, d, "model.lora key(s)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and dtypes of a Qwen2-style model; field names follow the HF config where one exists."""
  vocab_size: int = 128
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_seq_len: int = 256
  param_dtype: str = "float32"
  dtype: str = "float32"
  # The final norm and the LM head (logits, log-probs) in this dtype; "" = dtype. "float32" with bfloat16
  # layers: bf16 compute with a float32 log-prob head (its GEMMs at matmul_precision; "highest" = true f32).
  head_dtype: str = ""
  # Every dot in the model (learner log-probs and the sampler alike) runs at this precision.
  matmul_precision: str = "highest"
  # Layers under nn.scan: params (and the KV cache) stacked on a leading "layers" axis; compile time does not
  # grow with depth. False = layers_0 .. layers_{L-1}, the layout of checkpoints written before scan.
  scan_layers: bool = False
  remat: str = "none"          # a REMAT_CHOICES name, applied to every layer
  # remat="auto": GB per device the learner step may use; 0 = the device's own memory limit.
  remat_budget_gb: float = 0.0
  attention: str = "auto"      # a name in attention.IMPLEMENTATIONS
  # Where the attention mask is exactly causal (a full forward with no key mask: the learner's right-padded
  # rows), jax.nn's kernels get is_causal=True instead of a [B, T, S] boolean mask, which cuDNN turns into a
  # [B, 1, T, S] bias (and, in jax <= 0.11.0, a bias gradient). Same values; False: always the boolean mask.
  # True by default: the H100 program compiled on CPU loses the bias and its gradient (docs/gpu.md).
  causal_flag: bool = True
  # The LM head's log-probs (and their gradient), one of LM_HEADS: "vocab_chunks" = an online log-sum-exp
  # over vocabulary chunks of logits_chunk columns (vcpo_jax.model.lm_head: [tokens, vocab] float32 logits
  # never exist at once); "token_tiles" = full-vocabulary logits of logits_token_tile tokens at a time, one
  # GEMM per tile (lm_head_tiles); "plain" = full [tokens, vocab] logits, jax's own backward (lm_head_plain).
  # The per-sequence gradient-norm terms use vocabulary chunks, except under "plain".
  lm_head: str = "vocab_chunks"
  # Vocabulary columns per LM-head chunk; 0 = the plain full-logits path (as lm_head="plain").
  logits_chunk: int = 2048
  logits_token_tile: int = 1024  # tokens per tile of lm_head="token_tiles"
  # Low-rank adapters (rank 0 = off): the learner trains them alone; the model applies one (or, per row, one
  # of a stack) when the forward is given an adapter (vcpo_jax.model.lora).
  lora: LoraConfig = LoraConfig()

  def __post_init__(self):
    if not isinstance(self.lora, LoraConfig):  # a dict or ConfigDict (from_dict, JSON round trips)
      object.__setattr__(self, "lora", LoraConfig.from_dict(self.lora))
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"model.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                       f"model.num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
    if self.head_dtype and self.head_dtype not in _DTYPES:
      raise ValueError(f"model.head_dtype must be '' (model.dtype) or one of {sorted(_DTYPES)}, "
                       f"got {self.head_dtype!r}")
    if self.matmul_precision not in PRECISIONS:
      raise ValueError(f"model.matmul_precision must be one of {sorted(PRECISIONS)}, "
                       f"got {self.matmul_precision!r}")
    for name in ("scan_layers", "causal_flag"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"model.{name} must be a bool, got {getattr(self, name)!r}")
    if isinstance(self.logits_chunk, bool) or not isinstance(self.logits_chunk, int) or self.logits_chunk < 0:
      raise ValueError(f"model.logits_chunk must be an int >= 0 (0: full logits), got {self.logits_chunk!r}")
    if self.lm_head not in LM_HEADS:
      raise ValueError(f"model.lm_head must be one of {LM_HEADS}, got {self.lm_head!r}")
    tile = self.logits_token_tile
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
      raise ValueError(f"model.logits_token_tile must be a positive int, got {tile!r}")
    if self.remat not in REMAT_CHOICES:
      raise ValueError(f"model.remat must be one of {sorted(REMAT_CHOICES)}, got {self.remat!r}")
    if isinstance(self.remat_budget_gb, bool) or not isinstance(self.remat_budget_gb, (int, float)) or not (
        self.remat_budget_gb >= 0):
      raise ValueError(f"model.remat_budget_gb must be a number >= 0 (0: the device's memory), "
                       f"got {self.remat_budget_gb!r}")
    if self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f"model.attention must be one of {attention_lib.IMPLEMENTATIONS}, "
                       f"got {self.attention!r}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    return _from_dict(cls, d, "model config key(s)")

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def head_config(self) -> "ModelConfig":
    """This config with the head's dtype as the compute dtype (the final norm and the LM head run in it)."""
    return self if not self.head_dtype else dataclasses.replace(self, dtype=self.head_dtype, head_dtype="")

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def precision(self) -> jax.lax.Precision:
    return PRECISIONS[self.matmul_precision]

  @property
  def head_chunk(self) -> int:
    """Vocabulary columns per chunk of the LM head's vocab-chunk functions (0: full logits)."""
    return 0 if self.lm_head == "plain" else self.logits_chunk

  def head_logprob_args(self) -> dict:
    """Keyword arguments of lm_head.token_logprobs_and_entropy for this config's LM head."""
    return dict(precision=self.precision, chunk=self.head_chunk,
                token_tile=self.logits_token_tile if self.lm_head == "token_tiles" else 0)
