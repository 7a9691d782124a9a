import ast
from pathlib import Path

import megatron_multilevel

PACKAGE = Path(megatron_multilevel.__file__).parent
README = (PACKAGE.parent / "README.md").read_text()

# Pure maths: these modules must not depend on torch.distributed, Megatron or DeepSpeed.
PURE = ["operators.py", "ode_operators.py", "level_maps.py", "plan.py", "config.py", "config_parsing.py"]


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""


def test_operators_are_pure():
    for name in PURE:
        for module in _imports(PACKAGE / name):
            assert not module.startswith(("torch.distributed", "megatron.", "deepspeed")), (name, module)


def test_public_api_is_listed_in_readme():
    for name in megatron_multilevel.__all__:
        assert f"`{name}`" in README, name
        assert hasattr(megatron_multilevel, name)


def test_readme_holds_the_two_commands():
    assert "make run" in README and "make test" in README
    assert "launch/pretrain_vcycle.sh" in README and "python -m pytest -q tests" in README
    makefile = (PACKAGE.parent / "Makefile").read_text()
    assert "launch/pretrain_vcycle.sh" in makefile and '-m pytest -q tests' in makefile
    ci = (PACKAGE.parent / ".ci" / "run").read_text()
    assert "make test" in ci
