"""``tests/mutations.py`` breaks the code by exact text substitutions; a substitution whose text has
moved would stop the script at once, long after the move. This cheap check runs in the default set,
so that the move itself fails."""

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import mutations  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_text_is_found_once(mutation):
    for path, old, new in mutation.substitutions:
        count = (ROOT / path).read_text().count(old)
        assert count == 1, f"{mutation.name}: {path} holds its text {count} times (expected once): {old!r}"
        # the mutated file still parses: a mutation breaks behaviour, not the syntax
        ast.parse((ROOT / path).read_text().replace(old, new))


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_names_tests_that_exist(mutation):
    assert mutation.tests, mutation.name
    for test in mutation.tests:
        file, _, name = test.partition("::")
        assert (ROOT / file).is_file(), (mutation.name, test)
        if name:
            defined = {node.name for node in ast.walk(ast.parse((ROOT / file).read_text()))
                       if isinstance(node, ast.FunctionDef)}
            assert name.split("[")[0] in defined, (mutation.name, test)
