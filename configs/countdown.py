"""Main CPU job: SFT warm start, then asynchronous VCPO on Countdown with embedded rollout servers."""
import ml_collections

from vcpo_jax import tasks
from vcpo_jax.algo import losses
from vcpo_jax.job import configuration


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`arg` picks a variant: '' (the main job), 'sync' (k = 0), 'emulate' (in-process lag emulation), 'lora'
  (the main job training rank-16 adapters on the frozen warm-start base; the servers get adapters)."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  # A tiny Qwen2-style model; exported checkpoints load in transformers and SGLang.
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=128,          # >= the task tokenizer's vocabulary (padded to a multiple of 64)
      hidden_size=128,
      intermediate_size=384,
      num_layers=3,
      num_heads=4,
      num_kv_heads=2,
      head_dim=32,             # hidden_size / num_heads, as Qwen2 requires
      rope_theta=10000.0,
      rms_norm_eps=1e-6,
      tie_word_embeddings=False,
      max_seq_len=96,          # prompt (<= 60 tokens) + max_new_tokens
      param_dtype="float32",
      dtype="float32",
      # Precision of every matmul. "highest" keeps float32 log-probs (the importance ratios) exact on GPUs,
      # where "default" means TF32; with bfloat16 it changes nothing.
      matmul_precision="highest",
      # Layers under nn.scan (compile time independent of depth), the per-layer remat policy and the attention
      # (auto: cuDNN on GPU where supported, else jax.nn's XLA). At this size on CPU the unrolled einsum model is the faster RL step (measured: scan
      # 1.21x, jax.nn attention 1.10x per step). Checkpoints written before scan existed need scan_layers=False.
      scan_layers=False,
      remat="none",
      attention="einsum",
      # Low-rank adapters (docs/lora.md): only the adapter trains, the base stays frozen and is the KL reference.
      lora=ml_collections.ConfigDict(dict(
          rank=0,              # 0 = off (full fine-tuning); > 0: adapters of this rank
          alpha=32.0,          # scaling alpha / rank on (x A) B, exactly (no rsLoRA)
          # Hugging Face names of the decoder's linear layers that get an adapter (default: all seven).
          target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
      )),
  ))
  # Device mesh (data x fsdp x tensor); -1 takes the remaining devices.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  # Many hosts (docs/multihost.md): one process per host, the mesh spans every process's devices.
  c.distributed = ml_collections.ConfigDict(dict(
      auto=False,              # True: jax.distributed detects the cluster (TPU pod, SLURM, Open MPI)
      coordinator_address="",  # host:port of process 0 (when num_processes > 1 and not auto)
      num_processes=1,         # 1 = single process (jax.distributed is not started)
      process_id=0,
      heartbeat_timeout_s=100,  # a process silent this long is dead: every other one stops with an error
      timeout_s=1800.0,        # longest wait for another process (a step's batch, a barrier): hung otherwise
  ))

  c.task = ml_collections.ConfigDict(dict(
      name="countdown",        # a registered task (vcpo_jax/tasks)
      # One sub-dict per task with its constructor's options; only the chosen one's is read, e.g.
      # --config.task.name=arithmetic --config.task.options.arithmetic.max_digits=2.
      options=configuration.options_config(tasks.TASKS),
      eval_size=128,           # held-out prompts per evaluation (229 distinct exist at these options)
      eval_samples=1,          # temperature-1 draws per prompt behind eval/sampled_accuracy (greedy: one)
  ))
  # CPU-sized Countdown: two numbers in [1, 25]. The paper's 3-4 numbers in [1, 99] (min_numbers=3,
  # max_numbers=4, max_number=99) need a pretrained model: a 3-layer model warm-started here for minutes
  # stays at 0% on them.
  c.task.options.countdown.update(num_numbers=2, max_number=25, eval_fraction=0.2)

  # Supervised warm start on deliberately imperfect generated solutions (cached in workdir/base; a rerun in
  # that workdir with other seed, model, sft or task settings is refused, naming the field, except the
  # evaluation's own: task.eval_size, task.eval_samples and rl.max_new_tokens re-evaluate the cached weights).
  c.sft = ml_collections.ConfigDict(dict(
      steps=200,
      batch_size=32,
      learning_rate=1e-3,
      error_rate=0.6,          # fraction of warm-start targets that are plausible but wrong
  ))

  c.rl = ml_collections.ConfigDict(dict(
      steps=100,
      prompts_per_step=16,     # B_prompts; the batch has prompts_per_step * group_size sequences
      group_size=8,            # n samples per prompt
      max_new_tokens=24,
      temperature=1.0,
      mode="http",             # a registered rollout backend: SGLang-protocol servers, or in-process lag emulation
      max_lag=2,               # k: no sample is consumed with lag > k; 0 is synchronous
      # rl.mode=emulate: the lag of each group (rollout/emulation/lag_model.py). fixed: exactly min(t, k);
      # pipeline: what a real async run at this k gives, from a seeded simulation of the scheduler's rule with servers
      # generating server_rows rows at once at speed_ratio batches per learner step (a group's time varies
      # with coefficient of variation duration_cv; its first token comes after first_token_fraction of it).
      # Every mode logs the step's lag histogram (lag/frac_0..k). docs/results/lag_model.md: vs a real run.
      emulation=ml_collections.ConfigDict(dict(
          lag_model="fixed", speed_ratio=1.0, duration_cv=0.5, server_rows=64, first_token_fraction=0.0)),
      # Dynamic sampling (docs/dynamic-sampling.md): drop each group whose verifier outcomes do not spread (float64
      # std <= tolerance: no advantage) as it is scored, and refill its slot with a new prompt at the version then
      # served; only kept groups reach the learner (and count for the lag bound). More than max_drops_per_step
      # drops while one batch fills (0: 10 x prompts_per_step) ends the job with one line.
      # Fields and their checks: DynamicSamplingConfig (vcpo_jax/rollout/dynamic_sampling.py).
      dynamic_sampling=ml_collections.ConfigDict(dict(enabled=False, tolerance=1e-6, max_drops_per_step=0)),
      # DAPO's overlong shaping of the kept samples (vcpo_jax/rollout/overlong.py): penalty adds
      # 0 .. -1 as the generated tokens go from max_length - cache_length to max_length (0: rl.max_new_tokens; 0:
      # a fifth of it); mask_truncated takes samples cut by the length limit out of the loss (not the baseline).
      overlong=ml_collections.ConfigDict(dict(penalty=False, max_length=0, cache_length=0, mask_truncated=False)),
  ))

  c.algo = ml_collections.ConfigDict(dict(
      advantage="opob",        # a registered advantage estimator (algo/advantages.py)
      # One sub-dict per registered estimator with its options (fields and defaults from its options
      # dataclass); only the chosen one's is read, e.g. --config.algo.advantage_options.opob.aggregation=median.
      advantage_options=configuration.options_config(losses.ADVANTAGE_ESTIMATORS),
      policy_loss="vcpo",      # a registered policy loss (algo/policy_losses.py)
      # Likewise per loss, e.g. --config.algo.policy_loss=ppo --config.algo.policy_loss_options.ppo.clip_eps_low=0.1
      # (the tau of vcpo / seq_tis is algo.tis_threshold).
      policy_loss_options=configuration.options_config(losses.POLICY_LOSSES),
      aggregation="seq-mean-token-mean",   # token losses -> the loss (seq-mean-token-sum-norm: Dr.GRPO's)
      tis_threshold=8.0,       # tau for truncated sequence IS weights
      # The keyword arguments of scale_by_ess (learner/optimizer.py), passed as they are, plus its switch.
      ess=ml_collections.ConfigDict(dict(
          enabled=True,        # scale each step by rule(min(1, ESS ratio / base))
          # A number, or "auto" (the first step's ESS ratio); both work on the command line.
          base_ess_ratio=ml_collections.FieldReference(1.0, field_type=object),
          rule="sqrt",         # the scale is sqrt(s) or s (linear), s = min(1, ESS ratio / base)
          trigger=0.0,         # > 0: full step unless ratio / base < trigger
          min_ess_floor=0.0,   # > 0: multiply the step by min_ess_factor when ESS <= this floor (or NaN)
          min_ess_factor=0.5)),
      kl_beta=0.0,             # > 0: + beta * k3 KL to the frozen warm-start policy (computed in the step)
      # Per-sequence grad norms (learner/grad_path.py): book_keeping (one backward, keeps every layer's a/g),
      # bounded (norms layer by layer, then a backward: an ordinary step's memory), two_pass; auto = book-keeping
      # while its estimated a/g per device fit grad_memory_budget_gb, else bounded (choice logged at the 1st step).
      grad_path="auto",
      grad_memory_budget_gb=16.0,
      grad_norm_mode="auto",   # per-sequence grad norms: ghost or explicit products; auto: the fewer FLOPs
      # Rows per learner micro-batch (whole prompt groups, a scan): -1 = auto (whole groups up to
      # micro_batch_max_rows when the registered facts allow it, else 0), 0 = the whole batch at once.
      # Exact for group-local statistics; the step's memory shrinks with it and on CPU it is also faster.
      micro_batch_size=-1,
      micro_batch_max_rows=32,
      # True: each step also logs its update's norm and cosine with the update group-mean advantages would give
      # (update/*, grad/*; learner/update_diagnostics.py): one more backward pass per step, no change to training.
      update_diagnostics=False,
  ))

  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=2e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0,
      # The RL optimizer: adamw (b1, b2, eps, weight_decay) or sgd (heavy-ball `momentum`, no weight decay). The
      # warm start is AdamW either way (sft.learning_rate).
      name="adamw", momentum=0.9,
      # RL learning-rate schedule: a warmup, then for cosine and linear a decay to final_lr_fraction *
      # learning_rate at decay_steps (0 = rl.steps).
      schedule=ml_collections.ConfigDict(dict(name="constant", warmup_steps=0, decay_steps=0,
                                              final_lr_fraction=0.0)),
  ))

  c.rollout = ml_collections.ConfigDict(dict(
      num_servers=1,           # embedded servers started by the job (ignored when server_urls is set)
      server_urls="",          # comma-separated SGLang URLs; empty = start embedded servers
      # With server_urls: RL starts once this many of them answer (0 = all), waiting at most server_wait_s
      # seconds; the others join when they come up (health checks), as do servers that restart.
      min_servers=0,
      server_wait_s=600.0,
      base_port=0,             # 0 = pick free ports
      request_timeout=120.0,
      max_retries=4,
      keep_versions=3,         # exported weight directories kept on disk
      # dtype of the exported weights: "auto" = what the servers serve (the starting weights' config.json
      # torch_dtype: float32 for the embedded server, bfloat16 for a bf16 checkpoint), or a dtype.
      publish_dtype="auto",
      # where versions are exported: "" = RAM-backed (/dev/shm/vcpo-<job>, linked as WORKDIR/weights) when the
      # job starts its servers (no server_urls) and /dev/shm and free memory hold keep_versions + 2 versions,
      # else WORKDIR/weights; a path overrides (e.g. WORKDIR/weights keeps them on disk). Servers must read it.
      publish_dir="",
      # How each new version reaches the servers (docs/sglang.md): "disk" (export, update_weights_from_disk),
      # "wire" (a torch process group, bf16 buckets broadcast from the learner; needs torch) or "tensor" (servers
      # on this host: handles to shared memory, or CUDA IPC on GPUs, update_weights_from_tensor; needs torch).
      # The first load, a restarted server and a failed wire or tensor update always go by disk.
      publish="disk",
      wire_bucket_mb=512.0,    # bytes per bucket (a broadcast of SGLang's flattened_bucket; a tensor call)
      wire_backend="auto",     # auto: nccl on GPUs, else gloo
      wire_timeout_s=60.0,     # deadline of the group's forming, of each bucket's broadcast or tensor call
      wire_master_address="",  # where servers reach the learner ("" = loopback for local servers, else hostname)
      # GPUs (ignored on CPU). "" = automatic: one GPU is shared by the learner and the servers; with more,
      # servers take the last GPUs and the learner the rest. Else comma-separated GPU indices, one per server.
      server_devices="",
      # Share of a GPU each process may use when it shares that GPU (0 = no cap, grow on demand; a process
      # sharing a GPU never preallocates, so learner and servers fit side by side).
      learner_memory_fraction=0.0,
      server_memory_fraction=0.0,
      # CPUs every embedded server is confined to, as taskset writes them ("1", "8-15"); "" = the job's own.
      # With the job pinned elsewhere (experiments.launch.run_unit --cpu) learner and servers stop sharing cores.
      server_cpus="",
  ))

  # The task's reward as rollouts and evaluations compute it: off the rollout event loop, in a pool (thread:
  # in-process, for trusted fast rewards; process: worker processes, killable, for slow or untrusted verifiers).
  # A reward that raises, times out or is not a finite number scores 0 and is counted (reward/errors/<kind>,
  # per step with reward/calls).
  # Fields and their checks: RewardConfig (vcpo_jax/rollout/rewards.py).
  c.reward = ml_collections.ConfigDict(dict(
      pool="thread",
      workers=2,               # concurrent reward calls
      timeout_s=30.0,          # per call
      memory_mb=0,             # process pool: address-space limit per worker (0 = none)
  ))

  # Multi-turn tasks' tool calls and episode rewards: off the rollout event loop, in a pool of threads (an
  # episode's environment lives in this process). A call past the timeout is answered "error: the tool did not
  # answer in time" (tools/errors/timeout) and the episode goes on; its thread runs on until the tool returns.
  # Fields and their checks: ToolsConfig (vcpo_jax/rollout/episodes.py).
  c.tools = ml_collections.ConfigDict(dict(
      pool="thread",
      workers=8,               # concurrent tool calls
      timeout_s=30.0,          # per call
  ))

  c.eval_every = 20
  c.checkpoint_every = 10
  c.log_every = 1
  if arg == "sync":
    c.rl.max_lag = 0
  elif arg == "emulate":
    c.rl.mode = "emulate"
  elif arg == "lora":  # docs/lora.md
    c.model.lora.rank = 16
    # Adapters are commonly trained at about 10x full fine-tuning's rate (an untuned starting point).
    c.optim.learning_rate = 2e-3
  elif arg:
    raise ValueError(f"unknown config variant {arg!r}; known: '', 'sync', 'emulate', 'lora'")
  return c
