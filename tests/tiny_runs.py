"""Tiny job workdirs built in process for tests: what a lag-emulation run leaves at one of its checkpoints."""
import os


def emulated_checkpoint(workdir: str, step: int = 3, k: int = 2):
  """What a k-lag emulation run (configs/tiny.py:emulate, 2 prompts x 4 samples) leaves at checkpoint `step`:
  config.json, the orbax train state with the prompt iterator's state and the ring's version list, and the
  ring's past versions step-k..step-1 (perturbed params, so log w != 0). Returns the checkpoint's params."""
  import jax  # noqa: PLC0415
  from configs import tiny  # noqa: PLC0415
  from vcpo_jax.job import checkpointing, data, warm_start  # noqa: PLC0415
  from vcpo_jax.job.configuration import build_optimizer  # noqa: PLC0415
  from vcpo_jax.learner import train_state  # noqa: PLC0415
  from vcpo_jax.rollout.emulation import ring_store  # noqa: PLC0415
  c = tiny.get_config("emulate")
  c.rl.max_lag, c.rl.prompts_per_step, c.rl.group_size = k, 2, 4
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(c.to_json_best_effort(indent=2))
  model_cfg, tok, task, _ = warm_start.starting_point(c)
  state = train_state.create_train_state(model_cfg, build_optimizer(c), jax.random.PRNGKey(0))
  store = ring_store.RingStore(os.path.join(workdir, "emulation_ring"))
  for v in range(step - k, step):
    keys = iter(jax.random.split(jax.random.PRNGKey(v), len(jax.tree.leaves(state.params))))
    store.save(v, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), state.params))
  prompts = data.make_prompt_iterator(task, seed=c.seed, tokenizer=tok, shard_index=0, shard_count=1)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.save(step, state, {"data": prompts.get_state(), "step": step,
                                 "rollout": {"ring_versions": list(range(step - k, step))}})
  ckpt.close()
  return state.params
