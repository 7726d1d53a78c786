"""Writes a generated word-problem set (numeric answers, with a solution column) as verl-schema parquet and JSONL.

    python -m vcpo_jax.tasks.files.word_problems --out=DIR [--train_size=4000] [--test_size=512] [--seed=0]

DIR gets train.parquet, test.parquet, train.jsonl and test.jsonl: the same rows in both formats, in verl's
schema (`data_source`, `prompt` as chat messages, `ability`, `reward_model.ground_truth`, `extra_info`) plus a
`solution` column (the worked answer the warm start imitates; verl ignores extra columns). Test problems
never appear in train. Every text is printable ASCII, so the project's small task tokenizer encodes it.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

DATA_SOURCE = "word_problems"
INSTRUCTION = "Put the final answer in \\boxed{}."
NAMES = ("Ann", "Ben", "Cal", "Dee", "Eva", "Fay", "Gus", "Hal", "Ivy", "Jo")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells", "stamps", "rocks")


def _problem(rng: np.random.Generator) -> tuple[str, int, str]:
  """(question, answer, solution) from one of four templates."""
  a, b = (str(n) for n in rng.choice(NAMES, size=2, replace=False))
  item = str(rng.choice(ITEMS))
  kind = int(rng.integers(4))
  if kind == 0:
    x, y = (int(v) for v in rng.integers(2, 20, size=2))
    return (f"{a} has {x} {item}. {a} finds {y} more. How many {item} does {a} have now?", x + y,
            f"{x} + {y} = {x + y}")
  if kind == 1:
    x = int(rng.integers(5, 25))
    y = int(rng.integers(1, x))
    return (f"{a} has {x} {item} and gives {y} to {b}. How many {item} does {a} have left?", x - y,
            f"{x} - {y} = {x - y}")
  if kind == 2:
    x, y = (int(v) for v in rng.integers(2, 7, size=2))
    return (f"{a} buys {x} bags with {y} {item} in each bag. How many {item} does {a} buy?", x * y,
            f"{x} * {y} = {x * y}")
  x, y = (int(v) for v in rng.integers(2, 10, size=2))
  return (f"{a} has {x} {item}. {b} has {y} more than {a}. How many {item} do they have together?",
          2 * x + y, f"{x} + {y} = {x + y}\n{x} + {x + y} = {2 * x + y}")


def rows(train_size: int, test_size: int, seed: int = 0) -> dict[str, list[dict]]:
  """{'train': [...], 'test': [...]} verl-schema rows of distinct problems (test disjoint from train)."""
  rng = np.random.default_rng(seed)
  seen, problems = set(), []
  while len(problems) < train_size + test_size:
    question, answer, work = _problem(rng)
    if question not in seen:
      seen.add(question)
      problems.append((question, answer, work))
  out = {"test": problems[:test_size], "train": problems[test_size:]}
  return {split: [{
      "data_source": DATA_SOURCE,
      "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
      "ability": "math",
      "reward_model": {"style": "rule", "ground_truth": str(ans)},
      "extra_info": {"split": split, "index": i},
      "solution": f"{work}\n\\boxed{{{ans}}}",
  } for i, (q, ans, work) in enumerate(probs)] for split, probs in out.items()}


def write(out_dir: str, train_size: int = 4000, test_size: int = 512, seed: int = 0) -> dict[str, str]:
  """Writes the four files (each atomically); returns {name: path}."""
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415
  os.makedirs(out_dir, exist_ok=True)
  paths = {}
  for split, split_rows in rows(train_size, test_size, seed).items():
    for ext in ("parquet", "jsonl"):
      path = os.path.join(out_dir, f"{split}.{ext}")
      tmp = f"{path}.tmp{os.getpid()}"
      if ext == "parquet":
        pq.write_table(pa.Table.from_pylist(split_rows), tmp)
      else:
        with open(tmp, "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in split_rows)
      os.replace(tmp, path)
      paths[f"{split}.{ext}"] = path
  return paths


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="directory to write")
  parser.add_argument("--train_size", type=int, default=4000)
  parser.add_argument("--test_size", type=int, default=512)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for path in write(args.out, args.train_size, args.test_size, args.seed).values():
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
