import ast
from pathlib import Path

import megatron_multilevel

PACKAGE = Path(megatron_multilevel.__file__).parent

# The pure layer: operators on full tensors, the per-parameter plan and level maps, the config package,
# the cycle's shape and the FLOPs accounting. They must not depend on torch.distributed, Megatron or
# DeepSpeed, and neither may any module of the package they import, followed through the imports
# themselves (not a list of files), so that the rule keeps holding as code moves.
PURE = ["operators", "ode_operators", "level_maps", "plan", "config", "cycles", "flops", "methods", "records",
        "growth.fresh"]
FORBIDDEN = ("torch.distributed", "megatron.", "deepspeed")


def _module_file(name):
    """The source file of a module of the package (``config`` is a folder), or None."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path, *, top_level_only=False):
    """The modules ``path`` imports: ``(module, names)`` per statement, at any depth unless
    ``top_level_only`` (a deferred import inside a function runs only when it is called)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from ((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", tuple(a.name for a in node.names)


def _package_modules(module, names):
    """The package's own modules that ``from module import names`` loads (its parent packages too)."""
    if not module.startswith("megatron_multilevel"):
        return []
    parts = module.split(".")
    found = [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
    found += [f"{module}.{n}" for n in names if _module_file(f"{module}.{n}") is not None]
    return [m for m in found if _module_file(m) is not None]


def _reached(root):
    """Every module of the package that importing ``root`` may load, through any import statement."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for module, names in _imports(_module_file(name)):
            todo.extend(_package_modules(module, names))
    return seen


def test_operators_are_pure():
    for root in PURE:
        root = f"megatron_multilevel.{root}"
        assert _module_file(root) is not None, root
        reached = _reached(root)
        # the pure modules themselves (every module of a pure folder): no such import, not even deferred
        own = [m for m in reached if m == root or m.startswith(root + ".")]
        for name in own:
            for module, _ in _imports(_module_file(name)):
                assert not module.startswith(FORBIDDEN), (name, module)
        # and nothing they import loads one when imported
        for name in reached:
            for module, _ in _imports(_module_file(name), top_level_only=True):
                assert not module.startswith(FORBIDDEN), (root, "imports", name, "which imports", module)


def _all_modules():
    return sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
                  for p in PACKAGE.rglob("*.py"))


def _edges(name):
    """The package's modules ``name`` imports (any import statement), its own package left out."""
    out = set()
    for module, names in _imports(_module_file(name)):
        out.update(m for m in _package_modules(module, names) if m != name and not name.startswith(m + "."))
    return out


def test_no_import_loop():
    graph = {name: _edges(name) for name in _all_modules()}
    state = {}

    def visit(name, path):
        state[name] = "open"
        for nxt in sorted(graph.get(name, ())):
            if nxt == "megatron_multilevel":
                continue  # the package's __init__ re-exports; nothing imports it from inside
            assert state.get(nxt) != "open", f"import loop: {' -> '.join(path + [nxt])}"
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_config_imports_nothing_from_training_or_parallel():
    reached = _reached("megatron_multilevel.config")
    assert not [m for m in reached if m.startswith(("megatron_multilevel.training", "megatron_multilevel.parallel"))]


def _package_imports(name):
    """The package's modules that module ``name``'s import statements name (at any depth)."""
    return {m for module, names in _imports(_module_file(name)) for m in _package_modules(module, names)}


def _all_modules():
    return ["megatron_multilevel." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
            for p in PACKAGE.rglob("*.py")]


def test_the_study_stands_apart_from_the_product():
    """``study/`` (the savings arithmetic, the compared methods' configs, the report) reads only the
    ground floor (config, flops, methods, records): nothing of training, the parallel layer or the
    models; and of the package only the entry point, which reports a run's saving, imports it."""
    modules = _all_modules()
    study = [m for m in modules if m.startswith("megatron_multilevel.study")]
    assert study, modules
    forbidden = ("megatron_multilevel.training", "megatron_multilevel.parallel", "megatron_multilevel.models")
    for name in study:
        for used in _package_imports(name):
            assert not used.startswith(forbidden), (name, "imports", used)
    for name in modules:
        if name.startswith("megatron_multilevel.study") or name == "megatron_multilevel.pretrain":
            continue
        for used in _package_imports(name):
            assert not used.startswith("megatron_multilevel.study"), (name, "imports", used)
