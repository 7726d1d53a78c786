"""The GPU sweep's lever combinations (each with the reason it is there) and the model's real GEMM shapes."""
from __future__ import annotations

import dataclasses

# MaxText's GPU recipe (configs/gpu/a3/llama_2_7b/1vm.sh): latency-hiding scheduler, cuBLAS instead of Triton
# GEMMs, double-buffered while loops. Passed as compiler options (the XLA_FLAGS names without "--").
XLA_RECIPE = (("xla_gpu_enable_latency_hiding_scheduler", "true"), ("xla_gpu_enable_triton_gemm", "false"),
              ("xla_gpu_enable_while_loop_double_buffering", "true"))
CAUSAL = (("model.causal_flag", "True"),)
TILES = CAUSAL + (("model.lm_head", "token_tiles"),)


@dataclasses.dataclass(frozen=True)
class Lever:
  """One GRPO-step combination: job config overrides ("model.x", "value") and xla_* compiler options, on the
  GPU check's config (benchmarks/common/model_choice.py: Qwen2.5-0.5B shape, bf16 compute)."""
  name: str
  reason: str
  overrides: tuple[tuple[str, str], ...] = ()
  limit_s: float = 60.0     # its process's own limit on the GPU (compile + 1 warm-up + timed steps + profile)


# In priority order: when the sweep's time runs short the last ones are skipped (and reported as skipped).
LEVERS = (
    Lever("baseline", "the program the GPU check measured at 19.1% MFU on an H100 (benchmarks/gpu/results-gpu-steps.md):"
          " the boolean attention mask", (("model.causal_flag", "False"),)),
    Lever("causal", "suspect 1: is_causal instead of a boolean mask, so cuDNN reads no [B,1,T,S] bias and the "
          "backward writes no bias gradient (jax#34685)", CAUSAL),
    Lever("tiles", "suspect 2: the LM head (~27% of FLOPs) as 4 token tiles of 1024, one [1024,896]x[896,V] GEMM "
          "each, instead of 75 sequential vocabulary chunks", TILES),
    Lever("micro16", "suspect 3: 16 rows (8k tokens) per micro-batch: larger GEMM row blocks, half the "
          "accumulation steps", TILES + (("algo.micro_batch_size", "16"),)),
    Lever("xla_flags", "suspect 6: MaxText's XLA GPU flags (latency-hiding scheduler, cuBLAS over Triton GEMMs, "
          "double-buffered loops)", TILES + XLA_RECIPE),
    Lever("unrolled", "suspect 4: layers unrolled instead of nn.scan (scan overhead on GPU: jax#13356); compiles "
          "~3x longer", TILES + (("model.scan_layers", "False"),), limit_s=90.0),
    Lever("micro64", "no accumulation (32k tokens at once); remat='auto' picks what fits 80 GB (suspect 5: "
          "full remat costs ~33% more FLOPs)", TILES + (("algo.micro_batch_size", "64"),), limit_s=75.0),
    Lever("tiles4096", "one tile per micro-batch: the fewest head GEMMs (full f32 logits, 2.5 GB) with the bf16 "
          "custom backward", TILES + (("model.logits_token_tile", "4096"),)),
    Lever("plain", "full logits with jax's own backward (float32 GEMMs there): 'drop vocab chunking' "
          "(marin#2315)", CAUSAL + (("model.lm_head", "plain"),)),
    Lever("f32_head", "the precision lever: bf16 layers with a float32 'highest' LM head, its price in time "
          "(benchmarks/cpu/bf16_mismatch.py gives its mismatch)",
          TILES + (("model.head_dtype", "float32"), ("model.matmul_precision", "highest")), limit_s=75.0),
    Lever("float32", "configs/qwen2_5.py's shipped 0.5B default (float32 'highest', XLA attention): what it costs "
          "on a GPU", TILES + (("model.dtype", "float32"), ("model.matmul_precision", "highest")), limit_s=90.0),
)
# Levers that change the numbers the step computes (precision): never folded into the combined best.
NOT_COMBINED = ("f32_head", "float32")
COMBINED = "combined"


def add_model_fields(config, overrides):
  """Adds to config.model the ModelConfig fields the overrides name that the job config leaves at their defaults
  (so that apply_overrides, which sets only fields a config has, can set them)."""
  from vcpo_jax.model import config as model_config
  defaults = {f.name: f.default for f in dataclasses.fields(model_config.ModelConfig)}
  for key, _ in overrides:
    field = key.removeprefix("model.")
    if key.startswith("model.") and field in defaults and field not in config.model:
      config.model[field] = defaults[field]


def by_name(name: str) -> Lever:
  for lever in LEVERS:
    if lever.name == name:
      return lever
  raise ValueError(f"unknown lever {name!r}; known: {[lever.name for lever in LEVERS]}")


def combined(seconds: dict[str, float]) -> Lever | None:
  """The best measured lever plus every other measured one that beat 'tiles' (their common parent) and sets
  fields the best does not: the overrides that each helped, together. None when nothing beat the baseline."""
  timed = {k: v for k, v in seconds.items() if k not in NOT_COMBINED and k != COMBINED}
  if "baseline" not in timed or len(timed) < 2:
    return None
  best = min(timed, key=timed.get)
  if best == "baseline":
    return None
  overrides = dict(by_name(best).overrides)
  parent = timed.get("tiles", timed["baseline"])
  helped = [by_name(k) for k in sorted(timed, key=timed.get) if timed[k] < parent and k != best]
  for lever in helped:
    fields = dict(lever.overrides)
    if all(overrides.get(k, v) == v for k, v in fields.items()):  # no field the combination set otherwise
      overrides.update(fields)
  names = [best] + [lever.name for lever in helped if set(lever.overrides) <= set(overrides.items())]
  return Lever(COMBINED, f"the best ({best}) with every lever that beat its parent: {' + '.join(names)}",
               tuple(overrides.items()), limit_s=90.0)


def gemm_shapes(cfg, tokens: int) -> list[tuple[str, int, int, int, int]]:
  """(name, M, K, N, count per step) of the learner step's GEMMs for `tokens` tokens per micro-batch: each
  forward GEMM [M, K] x [K, N] and its two backward GEMMs (dX = dY W^T, dW = X^T dY), per layer times the
  layers; attention's batched matmuls (cuDNN) are not GEMMs here."""
  d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  forward = [("q_proj", d, q, L), ("k_proj+v_proj", d, kv, 2 * L), ("o_proj", q, d, L),
             ("gate_proj+up_proj", d, f, 2 * L), ("down_proj", f, d, L), ("lm_head", d, v, 1)]
  out = []
  for name, k, n, count in forward:
    out += [(f"{name} fwd", tokens, k, n, count), (f"{name} dX", tokens, n, k, count),
            (f"{name} dW", k, tokens, n, count)]
  return out
