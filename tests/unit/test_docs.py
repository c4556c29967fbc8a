"""Every example in Genie's docstrings runs and prints what it says (doctest)."""

import doctest
import importlib
import pkgutil

import pytest

import genie

# every module except the native one and the entry points (they run programs on import as main)
ENTRY_POINTS = {"genie.demo", "genie.server", "genie.remote.server"}
MODULES = sorted(m.name for m in pkgutil.walk_packages(genie.__path__, "genie.")
                 if not m.name.endswith("._C") and m.name not in ENTRY_POINTS)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    from genie import context

    if name == "genie.context" and not context._on:
        pytest.skip("GENIE_CONTEXT=0: its example shows the context the hooks record")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
