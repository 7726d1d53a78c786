"""Docs stay true: links, make targets, `python -m` modules, pointers from code and the config reference resolve."""
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted((ROOT / "docs").rglob("*.md"))
# Hand-written pages whose commands are checked; generated result pages (docs/results/**) only for links.
HAND_WRITTEN = [p for p in PAGES if "results" not in p.relative_to(ROOT).parts]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MAKE = re.compile(r"(?<![\w.-])make ((?:[A-Z_]+=\S+ )*)([a-z][\w-]*(?: [a-z][\w-]*)*)")
MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
# Modules from other projects' tools that a page may name (not this repository's).
EXTERNAL_MODULES = {"venv", "pip", "pytest", "tensorboard", "sglang.launch_server"}


def _code(text: str) -> str:
  """The text inside inline code spans and fenced blocks, where commands are written."""
  fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
  inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
  return "\n".join(fenced + inline)


def _text(page: pathlib.Path) -> str:
  """The page's text; a page not in this checkout skips its test."""
  if not page.exists():
    pytest.skip(f"{page.name} not present")
  return page.read_text()


def _make_targets() -> set[str]:
  text = (ROOT / "Makefile").read_text()
  return {m.group(1) for m in re.finditer(r"^([a-z][\w-]*)\s*:(?!=)", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
  text = _text(page)
  broken = []
  for target in LINK.findall(text):
    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
      continue  # URLs and in-page anchors
    path = target.split("#", 1)[0]
    if not (page.parent / path).exists():
      broken.append(target)
  assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_make_targets_exist(page):
  text = _text(page)
  targets = _make_targets()
  missing = set()
  for m in MAKE.finditer(_code(text)):
    for name in m.group(2).split():
      if name not in targets:
        missing.add(name)
  assert not missing, f"{page.relative_to(ROOT)} names make targets the Makefile lacks: {sorted(missing)}"


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_python_modules_exist(page):
  text = _text(page)
  sys.path.insert(0, str(ROOT))
  try:
    missing = sorted({name for name in MODULE.findall(_code(text))
                      if name not in EXTERNAL_MODULES and importlib.util.find_spec(name) is None})
  finally:
    sys.path.remove(str(ROOT))
  assert not missing, f"{page.relative_to(ROOT)} names `python -m` modules that do not exist: {missing}"


def test_readme_is_a_front_door():
  assert len((ROOT / "README.md").read_text().splitlines()) <= 220


@pytest.mark.integration  # a fresh process: other tests register test-only backends and tasks in this one
def test_configuration_reference_is_current():
  proc = subprocess.run([sys.executable, "-m", "vcpo_jax.job.config_reference", "--check"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (
      "docs/configuration.md is out of date: run `make docs` (python -m vcpo_jax.job.config_reference)\n"
      + proc.stdout + proc.stderr)


def test_config_reference_reads_comments():
  from vcpo_jax.job import source_comments
  source = "c.x = ml_collections.ConfigDict(dict(\n    a=1,  # the a\n    # about b\n    b=2,\n))  \n"
  known = source_comments.config_comments(source)
  assert known["x.a"][1] == "the a" and known["x.b"][1] == "about b"


# -- pointers from code, configs and scripts ----------------------------------------------------------------
POINTER_DIRS = ("vcpo_jax", "configs", "experiments", "benchmarks", "third_party", "tests")
README_SECTION = re.compile(r"README(?:'s)? \"([^\"]+)\"")
BARE_README = re.compile(r"(?<![\w/.])README(?!\.md|(?:'s)? \")")  # "see README": no section named
DOCS_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]*[\w/]")
# A page named without its folder ("see report.md"); an upper-case stem is a placeholder ("writes OUT.md").
BARE_MD = re.compile(r"(?<![\w/.$-])((?![A-Z_]+\.md)[\w-][\w.-]*\.md)\b")
OUTSIDE_DESIGN = re.compile(r"(?<![\w])(?:\.\./)?(?:/work/)?shared/design/|(?<![\w/.])design/[\w.-]+\.md")
ISSUE_NUMBER = re.compile(r"(?i)\bissues?\s*#\s*\d+|\bissues?\s+\d+\b|\(#\d+\b|^\s*(?:\"\"\")?#\d+\b")


def _tracked_files() -> list[pathlib.Path]:
  try:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
  except (OSError, subprocess.SubprocessError):
    pytest.skip("not a git checkout")
  return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def _pointer_sources() -> list[pathlib.Path]:
  """Code, configs and scripts: what a reader follows a pointer from (result data files left out)."""
  keep = (".py", ".sh", ".txt", ".md", ".toml", ".cfg")
  return [p for p in _tracked_files()
          if (p.parts[len(ROOT.parts)] in POINTER_DIRS and p.suffix in keep) or p.name == "Makefile"
          or (p.parent == ROOT and p.name.startswith("requirements") and p.suffix == ".txt")]


def _headings(text: str) -> list[str]:
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  return [m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)]


@pytest.mark.integration  # `git ls-files`: a process
def test_pointers_name_readme_sections_and_docs_that_exist():
  """README sections, docs/ paths and bare page names ("vcpo-algorithm.md") that code, configs and scripts
  point at all exist."""
  sections = {h.replace("`", "").lower() for h in _headings((ROOT / "README.md").read_text())}
  names = {p.name for p in _tracked_files()}
  bad = []
  for path in _pointer_sources():
    if path == pathlib.Path(__file__):
      continue
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
      where = f"{path.relative_to(ROOT)}:{n}"
      bad += [f"{where}: README has no section {s!r}" for s in README_SECTION.findall(line)
              if s.replace("`", "").lower() not in sections]
      bad += [f"{where}: names README without a section" for _ in BARE_README.findall(line)]
      bad += [f"{where}: {d} does not exist" for d in DOCS_PATH.findall(line) if not (ROOT / d).exists()]
      bad += [f"{where}: no tracked file is named {m}" for m in BARE_MD.findall(line) if m not in names]
      bad += [f"{where}: cites a design note outside the repository" for _ in OUTSIDE_DESIGN.findall(line)]
  assert not bad, "stale pointers:\n" + "\n".join(bad)


@pytest.mark.integration  # `git ls-files`: a process
def test_no_issue_numbers_in_file_names_docs_headings_or_code():
  bad = [str(p.relative_to(ROOT)) for p in _tracked_files()
         if re.search(r"(?i)issue[_-]?\d+|#\d+", p.name)]
  for page in PAGES + sorted((ROOT / "benchmarks").rglob("*.md")):
    bad += [f"{page.relative_to(ROOT)}: heading {h!r}" for h in _headings(page.read_text())
            if ISSUE_NUMBER.search(h) or re.search(r"\(issue", h, flags=re.I)]
  for path in _pointer_sources():
    lines = path.read_text(errors="replace").splitlines() if path != pathlib.Path(__file__) else []
    bad += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(lines, 1) if ISSUE_NUMBER.search(line)]
  assert not bad, "issue numbers (describe the project as it is):\n" + "\n".join(bad)


def test_a_bare_page_name_is_found_and_a_placeholder_is_not():
  assert BARE_MD.findall("see vcpo-algorithm.md §7 and report.md") == ["vcpo-algorithm.md", "report.md"]
  assert BARE_MD.findall("writes OUT.md, DIR/pilot.md and docs/x.md") == []


def test_changelog_is_by_version():
  """`## Unreleased`, then one `## X.Y.Z` per version, the package's own among them; nothing else at that level."""
  version = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
  levels = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
  assert levels[0] == "Unreleased", levels
  assert all(re.fullmatch(r"\d+\.\d+\.\d+", h) for h in levels[1:]), levels
  assert version in levels, f"pyproject.toml's version {version} has no CHANGELOG section: {levels}"
