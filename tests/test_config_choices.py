"""Choice lists: the configs' comments keep none by hand; the reference lists each fixed field's from its check."""
import pathlib
import re
import tokenize

import ml_collections
import pytest

from configs import countdown
from vcpo_jax.job import config_reference, configuration

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAND_LIST = re.compile(r"\b[\w.-]+ \| [\w.-]+")  # "grpo | opob", "sqrt | linear"


def _config_files() -> list[pathlib.Path]:
  return sorted((ROOT / "configs").glob("*.py")) + sorted((ROOT / "experiments").rglob("config*.py"))


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_config_comment_lists_the_choices_by_hand(path):
  with open(path) as f:
    comments = [(t.start[0], t.string) for t in tokenize.generate_tokens(f.readline) if t.type == tokenize.COMMENT]
  assert [(n, c) for n, c in comments if HAND_LIST.search(c)] == []


def test_the_hand_list_pattern_finds_one():
  assert HAND_LIST.search("# sqrt | linear") and not HAND_LIST.search("# a sqrt or linear rule")


def test_the_reference_lists_each_fixed_fields_choices():
  rows = {line.split("|")[1].strip().strip("`"): line for line in config_reference.render().splitlines()
          if line.startswith("| `")}
  for field, names in config_reference.fixed_choices().items():
    assert field in rows, field
    assert all(f"`{n}`" in rows[field] for n in names), rows[field]


@pytest.mark.parametrize("field", sorted(config_reference.fixed_choices()))
def test_each_fixed_field_is_checked_against_its_list(field):
  """A name outside the reference's list is refused at validation, with an error naming the field and every
  name in the list: the list the reference shows is the one the check reads."""
  config = ml_collections.ConfigDict(countdown.get_config().to_dict(), type_safe=False)
  *sections, key = field.split(".")
  node = config
  for name in sections:
    node = node[name]
  node[key] = "not_a_choice"
  with pytest.raises(ValueError, match=re.escape(key)) as e:
    configuration.validate_config(config)
  assert all(f"'{n}'" in str(e.value) for n in config_reference.fixed_choices()[field]), str(e.value)
