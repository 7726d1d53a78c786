"""The `dataset` task: problems from the user's train and eval files (verl schema or plain rows), answers
checked by a verifier chosen for the whole task or per data_source."""
from __future__ import annotations

import functools

import hashlib
import json
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vcpo_jax.model import tokenizer as tokenizer_lib
from vcpo_jax.tasks import base
from vcpo_jax.tasks.files import reading as dataset_files, verifiers

FIELD = "task.options.dataset"
# Room left for a warm-start target's wrong variant (a changed final number) beyond the reference's length.
SFT_MARGIN_TOKENS = 8


def parse_mapping(text: str | Mapping[str, str], field: str) -> dict[str, str]:
  """'openai/gsm8k=gsm8k,lighteval/MATH=math' (or a mapping) -> {data_source: verifier}."""
  if isinstance(text, Mapping):
    return {str(k): str(v) for k, v in text.items()}
  out = {}
  for item in filter(None, (s.strip() for s in (text or "").split(","))):
    source, eq, spec = item.rpartition("=")
    if not eq or not source.strip() or not spec.strip():
      raise ValueError(f"{field}={text!r}: item {item!r} is not <data_source>=<verifier>")
    out[source.strip()] = spec.strip()
  return out


@base.register_task
class Dataset(base.Task):
  """Knobs: the files (comma-separated paths, JSONL or parquet), the schema and plain-row keys, the prompt's
  system turn and instruction suffix (plain text questions only), the verifier (a registered name or
  'module:function'), verifiers per data_source ('source=name,...') and verifier options
  ('name.option=value,...'); and, as every task, a tool environment (base.Task: `environment`, a registered
  name or 'module:Class', `environment_options`, `max_turns`)."""

  name = "dataset"
  from_files = True

  def __init__(self, train_files: str = "", eval_files: str = "", schema: str = "auto",
               question_key: str = "question", answer_key: str = "answer", solution_key: str = "solution",
               system_prompt: str = "", instruction: str = "", verifier: str = "math",
               verifier_by_source: str = "", verifier_options: str = "", environment: str = "",
               environment_options: str = "", max_turns: int = 4, tool_pool=None):
    self._rendered: dict[str, list[base.Example]] = {}
    super().__init__(environment=environment, environment_options=environment_options, max_turns=max_turns,
                     tool_pool=tool_pool)
    keys = dataset_files.Keys(question_key, answer_key, solution_key)
    read = dict(schema=schema, keys=keys, system_prompt=system_prompt, instruction=instruction)
    self._records = {
        "train": dataset_files.read_records(dataset_files.split_paths(train_files, f"{FIELD}.train_files"),
                                            field=f"{FIELD}.train_files", **read),
        "eval": dataset_files.read_records(dataset_files.split_paths(eval_files, f"{FIELD}.eval_files"),
                                           field=f"{FIELD}.eval_files", **read)}
    options = verifiers.parse_options(verifier_options, f"{FIELD}.verifier_options")
    self._default_verifier = verifiers.build_verifier(verifier, options, field=f"{FIELD}.verifier")
    by_source = parse_mapping(verifier_by_source, f"{FIELD}.verifier_by_source")
    sources = {r.data_source for rs in self._records.values() for r in rs}
    unknown = sorted(set(by_source) - sources)
    if unknown:
      raise ValueError(f"{FIELD}.verifier_by_source={verifier_by_source!r}: no row has data_source {unknown}; "
                       f"the files' data sources: {sorted(sources)}")
    self._verifiers = {s: verifiers.build_verifier(spec, options, field=f"{FIELD}.verifier_by_source[{s!r}]")
                       for s, spec in by_source.items()}
    self._keep = {"train": None, "eval": None, "sft": None}  # row indices that fit the context (fit_context)

  # ---------------------------------------------------------------------------------------- examples
  def use_chat_template(self, render_prompt: Callable[[str], str]) -> "Dataset":
    self._rendered = {}
    return super().use_chat_template(render_prompt)

  def _render(self, messages: Sequence[Mapping[str, str]]) -> str:
    # A chat format (the tokenizer's ChatFormat) renders the whole list, declaring the environment's tools;
    # the bare default renders ChatML.
    render = getattr(self.chat, "render", None) or tokenizer_lib.TASK_CHAT.render
    return render(list(messages), tools=self.tool_declarations())

  def _example(self, record: dataset_files.Record) -> base.Example:
    messages = [dict(m) for m in record.messages]
    key = hashlib.sha256(json.dumps([messages, record.ground_truth]).encode()).hexdigest()[:16]
    return {"task": self.name, "key": f"dataset:{key}", "prompt": self._render(messages), "messages": messages,
            "ground_truth": record.ground_truth, "data_source": record.data_source,
            "extra_info": record.extra_info, "solution": record.solution}

  def _all(self, split: str) -> list[base.Example]:
    if split not in self._rendered:
      self._rendered[split] = [self._example(r) for r in self._records[split]]
    return self._rendered[split]

  def _kept(self, split: str, keep_key: str | None = None) -> list[base.Example]:
    rows, keep = self._all(split), self._keep[keep_key or split]
    return list(rows) if keep is None else [rows[i] for i in keep]

  def train_examples(self) -> list[base.Example]:
    """The train files' rows that fit the context, in file order."""
    return self._kept("train")

  def sft_examples(self) -> list[base.Example]:
    """Train rows whose prompt and warm-start target fit the context."""
    return self._kept("train", "sft")

  def eval_set(self, n: int, seed: int = 0) -> list[base.Example]:
    """The first n eval rows that fit the context, in file order (all of them when there are fewer)."""
    del seed  # the user's eval file fixes the set
    return self._kept("eval")[:n]

  def sample(self, rng_or_seed: base.RngLike, n: int, split: str = "train") -> list[base.Example]:
    """n rows of `split` drawn uniformly with replacement."""
    if split not in base.SPLITS:
      raise ValueError(f"split must be one of {base.SPLITS}, got {split!r}")
    rows = self._kept(split)
    return [rows[int(i)] for i in base.as_rng(rng_or_seed).integers(len(rows), size=n)]

  def fit_context(self, tok, max_seq_len: int, max_new_tokens: int) -> dict[str, int]:
    """Keeps rows whose prompt + max_new_tokens fit max_seq_len (and, for the warm start, whose prompt +
    reference solution fit); returns the counts skipped. A prompt the tokenizer cannot encode is an error."""
    skipped = {}
    for split in ("train", "eval"):
      lengths = [self._prompt_length(tok, ex, r.where) for ex, r in zip(self._all(split), self._records[split])]
      self._keep[split] = [i for i, n in enumerate(lengths) if n + max_new_tokens <= max_seq_len]
      skipped[f"dataset/skipped_{split}_rows"] = len(lengths) - len(self._keep[split])
      if not self._keep[split]:
        raise ValueError(f"{FIELD}.{split}_files: no row fits max_seq_len={max_seq_len} with "
                         f"max_new_tokens={max_new_tokens} (shortest prompt: {min(lengths)} tokens)")
      if split == "train":
        self._keep["sft"] = [i for i in self._keep["train"] if lengths[i] + SFT_MARGIN_TOKENS + 1 + len(
            tok.encode(self.reference_solution(self._all("train")[i]))) <= max_seq_len]
        skipped["dataset/skipped_sft_rows"] = len(self._keep["train"]) - len(self._keep["sft"])
    if skipped["dataset/skipped_sft_rows"] == len(self._keep["train"]):
      self._keep["sft"] = None  # none fits: a warm start (if any) fails loudly in encode_sft_example
    logging.info("dataset rows longer than the context (max_seq_len=%d, max_new_tokens=%d), skipped: %s",
                 max_seq_len, max_new_tokens, skipped)
    return skipped

  @staticmethod
  def _prompt_length(tok, example: base.Example, where: str) -> int:
    try:
      return len(tok.encode(example["prompt"]))
    except ValueError as e:
      raise ValueError(f"{where}: field 'prompt' cannot be encoded by the job's tokenizer: {e}") from None

  # ----------------------------------------------------------------------------------------- rewards
  def verifier_for(self, example: base.Example) -> verifiers.Verifier:
    """The picklable verifier of the example's data_source (the task's default when none is named)."""
    return self._verifiers.get(example.get("data_source"), self._default_verifier)

  def reward(self, example: base.Example, completion: str) -> float:
    return float(self.verifier_for(example)(example, completion))

  def reward_function(self) -> Callable[[base.Example, str], float]:
    """The verifiers by data_source as one picklable function: the reward pool may run it in worker processes
    (reward.pool='process'), where math-verify's own signal-based timeouts work."""
    return functools.partial(verifiers.by_source, dict(self._verifiers), self._default_verifier)

  def reward_initializer(self) -> Callable[[], None]:
    """Each reward worker imports the verifiers' heavy dependencies before its first, timed, call."""
    return verifiers.preload

  def reference_solution(self, example: base.Example, rng: base.RngLike | None = None) -> str:
    """The row's solution column, else a bare boxed ground truth."""
    del rng
    return example.get("solution") or f"The final answer is \\boxed{{{example['ground_truth']}}}."

  def wrong_completion(self, example: base.Example, rng: np.random.Generator) -> str:
    """The reference with its final result miscalculated (one more, else a nearby number) wherever the last step
    writes it (`= N` and the boxed answer), checked to score 0. One systematic slip, as countdown's off-by-one
    literal: at sft.error_rate >= 0.5 the warm start's greedy answer follows it, and RL has a habit to unlearn;
    random nearby numbers only spread the sampled mass and leave the greedy answer right."""
    del rng  # the slip is the same for every draw
    reference, truth = self.reference_solution(example), example["ground_truth"]
    value = verifiers.parse_number(truth)
    if value is not None:
      candidates = [_number_text(value + d) for d in (1, -1, 2, 10)]
    else:
      candidates = [f"{truth} + 1", f"2 {truth}"]
    for candidate in candidates:
      wrong = _replace_last(reference, f"= {truth}", f"= {candidate}")
      at = wrong.rfind(truth)
      wrong = (wrong[:at] + candidate + wrong[at + len(truth):] if at >= 0
               else f"{wrong}\nThe final answer is \\boxed{{{candidate}}}.")
      if self.reward(example, wrong) == 0.0:
        return wrong
    return "I cannot solve this."


def _replace_last(text: str, old: str, new: str) -> str:
  at = text.rfind(old)
  return text if at < 0 else text[:at] + new + text[at + len(old):]


def _number_text(value: Any) -> str:
  return str(value.numerator) if value.denominator == 1 else str(float(value))

