"""RL on your own dataset files (the `dataset` task), and a CPU demo on generated word problems.

  python -m vcpo_jax.main --config=configs/dataset.py --workdir=runs/mine \
      --config.task.options.dataset.train_files=train.parquet --config.task.options.dataset.eval_files=test.parquet
  python -m vcpo_jax.main --config=configs/dataset.py:demo --workdir=runs/word_problems

`arg`: '' (your files, the CPU model of configs/countdown.py), 'demo' (word problems from
vcpo_jax/tasks/files/word_problems.py, written on first use to $VCPO_WORD_PROBLEMS or else workdir/word_problems
in this checkout, read as parquet) or 'demo_jsonl' (the same rows read from the JSONL files). For a pretrained model use
configs/qwen2_5.py with --config.task.name=dataset and the same task options (docs/data.md).
"""
import os

import ml_collections

from configs import countdown

# The demo's files ($VCPO_WORD_PROBLEMS, else workdir/word_problems in this checkout).
DEMO_DIR = os.environ.get("VCPO_WORD_PROBLEMS") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "workdir", "word_problems")
VARIANTS = ("", "demo", "demo_jsonl")


def demo_files(ext: str, directory: str = DEMO_DIR) -> tuple[str, str]:
  """(train, test) paths of the demo set, written by vcpo_jax.tasks.files.word_problems if absent."""
  directory = os.path.normpath(directory)
  train, test = (os.path.join(directory, f"{split}.{ext}") for split in ("train", "test"))
  if not (os.path.exists(train) and os.path.exists(test)):
    from vcpo_jax.tasks.files import word_problems as make_word_problems  # noqa: PLC0415 - only the demo needs it
    make_word_problems.write(directory)
  return train, test


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; known: {VARIANTS}")
  c = countdown.get_config()
  c.task.name = "dataset"
  c.task.options.dataset.update(
      # Comma-separated JSONL / parquet paths; verl-schema rows or plain rows (question / answer / solution).
      train_files="", eval_files="",
      verifier="math",               # a registered verifier (docs/configuration.md) or a 'module:function' of yours
  )
  c.task.eval_size = 512             # the first eval rows that fit the context (all when there are fewer)
  # Verifiers run in worker processes: killable at their timeout, and math-verify's own timeouts work there.
  c.reward.update(pool="process", workers=2, timeout_s=10.0)
  c.task.eval_samples = 1            # samples per problem behind eval/avg@n and eval/pass@k
  if arg.startswith("demo"):
    train, test = demo_files("jsonl" if arg == "demo_jsonl" else "parquet")
    c.task.options.dataset.update(train_files=train, eval_files=test, verifier="gsm8k")
    c.task.eval_size = 256
    c.task.eval_samples = 4
    # Prompts are <= 97 task-tokenizer ids; the worked solutions <= 30.
    c.model.max_seq_len = 144
    c.rl.max_new_tokens = 40
    # 600 warm-start steps on worked solutions half of which miscalculate the last step by one (the dataset
    # task's wrong_completion): the warm start's greedy answer follows the slip on about half the problems it
    # can solve, and groups of 8 samples carry reward variance; RL removes the habit.
    c.sft.update(steps=600, error_rate=0.5)
    c.rl.steps = 100
    c.eval_every = 25
  return c
