"""The package's layers: no module imports a higher layer, a sibling package or a package its own is kept from,
and no import cycle exists."""
import ast
import os

import pytest

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vcpo_jax")

# Lowest first. A module may import its own package and any lower rank; packages sharing a rank are siblings
# that never import each other (algo/ and tasks/ both sit on the model and know nothing of one another; the
# learner sees only batches and rollout/ only groups: the job builds the one from the other).
RANKS = (("registry", "orphans"), ("calls",), ("parallel",), ("model",), ("algo", "tasks"), ("learner", "rollout"), ("serving",),
         ("job",), ("main",))
RANK = {unit: i for i, units in enumerate(RANKS) for unit in units}
# Lower packages a package may not import although its rank allows it: rollout/ is host-side asyncio that
# never places arrays on devices or talks to other processes (the job feeds every process its rows).
KEPT_FROM = {"rollout": ("parallel",)}
# ...but the servers rollout/ starts need their share of the job's device plan (environment variables and CPU
# masks, decided with the learner's, no JAX): that one module of parallel/ it may take.
ROLLOUT_USES_FROM_PARALLEL = {"vcpo_jax.parallel.placement"}
# What serving/ (the embedded server) takes from rollout/: the wire formats it shares with the client and the
# publisher: requests (protocol), and weight updates (the bucket layout and the torch group's handshake).
SERVING_USES_FROM_ROLLOUT = {"vcpo_jax.rollout.protocol", "vcpo_jax.rollout.servers.wire_pack",
                             "vcpo_jax.rollout.servers.wire_group"}


def unit_of(module: str) -> str:
  """'vcpo_jax.learner.step' -> 'learner' (the package, or the top-level module's name)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def import_graph(package_dir: str = PACKAGE_DIR) -> dict[str, set[str]]:
  """module -> the vcpo_jax modules it imports, function-local imports included."""
  modules = {}
  for root, _, files in os.walk(package_dir):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        rel = os.path.relpath(path, os.path.dirname(package_dir))[:-3].replace(os.sep, ".")
        modules[rel.removesuffix(".__init__")] = path
  graph = {}
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read())
    deps = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vcpo_jax"):
        for alias in node.names:  # `from vcpo_jax.pkg import module` names a module; else the module itself
          full = f"{node.module}.{alias.name}"
          deps.add(full if full in modules else node.module)
      elif isinstance(node, ast.Import):
        deps.update(a.name for a in node.names if a.name.startswith("vcpo_jax"))
    graph[module] = {d for d in deps if d in modules and d != module}
  return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  out = []
  for module, deps in sorted(graph.items()):
    me = unit_of(module)
    if me == "__init__":
      continue
    for dep in sorted(deps):
      other = unit_of(dep)
      if other in (me, "__init__"):
        continue
      if other in KEPT_FROM.get(me, ()) and not (me == "rollout" and dep in ROLLOUT_USES_FROM_PARALLEL):
        out.append(f"{module} imports {dep}: {me} is kept from {other}")
      elif RANK[other] > RANK[me]:
        out.append(f"{module} imports {dep}: {other} is above {me}")
      elif RANK[other] == RANK[me]:
        out.append(f"{module} imports {dep}: {other} and {me} are siblings")
  return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_every_package_has_a_rank():
  units = {unit_of(m) for m in import_graph()} - {"__init__"}
  assert units <= set(RANK), f"packages without a layer: {sorted(units - set(RANK))}"


def test_no_module_imports_a_higher_layer_or_a_sibling():
  assert layer_violations(import_graph()) == []


def test_algo_and_learner_never_import_rollout_or_serving():
  graph = import_graph()
  bad = [(m, d) for m, deps in graph.items() if unit_of(m) in ("algo", "learner")
         for d in deps if unit_of(d) in ("rollout", "serving", "job")]
  assert bad == []


def test_rollout_never_imports_learner_or_parallel_beyond_the_device_plan():
  graph = import_graph()
  bad = [(m, d) for m, deps in graph.items() if unit_of(m) == "rollout"
         for d in deps if unit_of(d) in ("learner", "parallel", "serving", "job")
         and d not in ROLLOUT_USES_FROM_PARALLEL]
  assert bad == []


def test_the_device_plan_imports_no_jax_at_module_level():
  """What rollout/ takes from parallel/ must not pull in devices: jax only inside configure_learner."""
  with open(os.path.join(PACKAGE_DIR, "parallel", "placement.py")) as f:
    tree = ast.parse(f.read())
  top = {a.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for a in node.names}
  top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
  assert not top & {"jax", "jaxlib", "flax", "vcpo_jax"}, sorted(top)


def test_serving_takes_only_the_wire_format_from_rollout():
  graph = import_graph()
  used = {d for m, deps in graph.items() if unit_of(m) == "serving" for d in deps if unit_of(d) == "rollout"}
  assert used <= SERVING_USES_FROM_ROLLOUT, sorted(used - SERVING_USES_FROM_ROLLOUT)


def test_no_import_cycles():
  assert cycles(import_graph()) == []


@pytest.mark.parametrize("graph,expected", [
    ({"vcpo_jax.model.hf": {"vcpo_jax.job.multihost"}, "vcpo_jax.job.multihost": set()}, "above"),
    ({"vcpo_jax.algo.vcpo": {"vcpo_jax.tasks.base"}, "vcpo_jax.tasks.base": set()}, "siblings"),
    ({"vcpo_jax.rollout.types": {"vcpo_jax.learner.batch"}, "vcpo_jax.learner.batch": set()}, "siblings"),
    ({"vcpo_jax.learner.step": {"vcpo_jax.rollout.types"}, "vcpo_jax.rollout.types": set()}, "siblings"),
    ({"vcpo_jax.rollout.client.pool": {"vcpo_jax.parallel.processes"}, "vcpo_jax.parallel.processes": set()},
     "kept from"),
    ({"vcpo_jax.rollout.servers.launcher": {"vcpo_jax.parallel.placement", "vcpo_jax.parallel.sharding"},
      "vcpo_jax.parallel.placement": set(), "vcpo_jax.parallel.sharding": set()}, "kept from"),
])
def test_the_checker_flags_upward_and_sibling_imports(graph, expected):
  violations = layer_violations(graph)
  assert len(violations) == 1 and expected in violations[0]


def test_the_checker_finds_a_cycle():
  graph = {"vcpo_jax.job.a": {"vcpo_jax.job.b"}, "vcpo_jax.job.b": {"vcpo_jax.job.c"},
           "vcpo_jax.job.c": {"vcpo_jax.job.a"}, "vcpo_jax.job.d": {"vcpo_jax.job.a"}}
  assert cycles(graph) == [["vcpo_jax.job.a", "vcpo_jax.job.b", "vcpo_jax.job.c"]]
