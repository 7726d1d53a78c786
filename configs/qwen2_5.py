"""Qwen2.5 shapes (0.5B, 1.5B, 7B) on the paper's Countdown; start from a checkpoint with model.hf_path=DIR.

  python -m vcpo_jax.main --config=configs/qwen2_5.py:0.5b --workdir=runs/q05 \
      --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct

`arg` is "<size>" or "<size>,<variant>" with size in 0.5b | 1.5b | 7b and variant in sync | emulate (as in
configs/countdown.py). With hf_path the architecture comes from the directory's config.json (the variant's
shape must match it), the tokenizer and chat template from its tokenizer files; max_seq_len, dtypes and
matmul precision stay as set here. Without hf_path the model starts from random weights (benchmarks).
"""
import ml_collections

from configs import countdown

# Numbers from the released Qwen2.5 config.json files.
SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                 num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                 num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
               num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
}

# The device each size is documented to fit at its own rows (rl.max_new_tokens + the prompt, one group of 8 rows
# per learner micro-batch): (GPUs, GB each). At the paper's long-response rows (8 rows of 8,192 tokens) every
# size is documented on LONG_ROWS_DEVICES, fsdp over all of them. tests/test_remat_auto.py checks them with XLA's
# memory analysis of the compiled step.
DEVICES = {"0.5b": (1, 80.0), "1.5b": (1, 80.0), "7b": (8, 80.0)}
LONG_ROWS_DEVICES = (8, 80.0)


def get_config(arg: str = "0.5b") -> ml_collections.ConfigDict:
  size, _, variant = (arg or "0.5b").partition(",")
  if size not in SHAPES:
    raise ValueError(f"unknown Qwen2.5 size {size!r}; known: {sorted(SHAPES)} (e.g. configs/qwen2_5.py:0.5b)")
  c = countdown.get_config(variant)
  c.model = ml_collections.ConfigDict(dict(
      **SHAPES[size],
      rope_theta=1000000.0,
      rms_norm_eps=1e-6,
      max_seq_len=640,             # chat-template prompt (~110 tokens with the default system turn) + 512
      param_dtype="float32",
      # float32 compute at "highest" keeps learner and sampler log-probs within 1e-4 per token (the IS
      # ratios); the 7B uses bfloat16 compute to fit (docs/gpu.md measures bf16's mismatch).
      dtype="bfloat16" if size == "7b" else "float32",
      matmul_precision="default" if size == "7b" else "highest",
      scan_layers=True,            # one compiled layer: the step compiles in the same time at any depth
                                   # (False: unrolled, as GPU recipes run; compiles ~3x longer at 24 layers)
      # The jax.checkpoint policy per layer; auto: the least recomputation
      # whose estimated step memory fits remat_budget_gb per device (0: the device's memory); choice and
      # estimates are logged when the step is first traced (vcpo_jax/model/remat.py).
      remat="auto",
      remat_budget_gb=0.0,
      attention="auto",            # cuDNN flash attention on GPU with bf16/fp16, else jax.nn's XLA path
      # The learner's exactly-causal forward hands attention is_causal=True, not a boolean mask (cuDNN then
      # reads no [B, 1, T, S] bias and writes no bias gradient; the same values: docs/gpu.md, GPU levers).
      causal_flag=True,
      # LM head: vocab_chunks (logits_chunk columns at a time), token_tiles (logits_token_tile tokens of
      # full-vocabulary logits at a time) or plain; head_dtype="float32" with bfloat16 compute keeps the final
      # norm and the head in float32 (docs/gpu.md, GPU levers).
      lm_head="vocab_chunks",
      logits_chunk=2048,
      logits_token_tile=1024,
      head_dtype="",
      hf_path="",                  # a local Hugging Face Qwen2/Qwen2.5 directory; "" = random init
  ))
  c.mesh.update(data=1, fsdp=-1, tensor=1)   # parameters and optimizer state sharded over every device
  # The paper's Countdown: 3-4 numbers in [1, 99].
  c.task.options.countdown.update(num_numbers=None, min_numbers=3, max_numbers=4, max_number=99, eval_fraction=0.1)
  c.task.eval_size = 256
  c.sft.steps = 0                  # a pretrained (instruct) model needs no warm start
  c.rl.update(steps=200, prompts_per_step=16, group_size=8, max_new_tokens=512)
  c.algo.micro_batch_size = 8      # one prompt group per learner micro-batch: bounds [tokens, vocab] logits
  # Per-sequence norms by memory (learner/grad_path.py): book-keeping while its a/g per device fit the budget,
  # else the bounded path; the choice and its reason are logged when the step is first traced.
  c.algo.update(grad_path="auto", grad_memory_budget_gb=16.0)
  c.optim.update(learning_rate=1e-6, weight_decay=0.0)
  c.eval_every = 25
  c.checkpoint_every = 25
  return c
