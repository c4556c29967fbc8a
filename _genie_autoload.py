"""``torch.backends`` entry point of the genie-remote-accelerator distribution.

``import torch`` imports every ``torch.backends`` entry point and turns any exception into
``RuntimeError: Failed to load the backend extension``. This module has a name no other project
uses, so torch always finds it; it then registers the device only if the ``genie`` that Python
would import is the package installed beside it. A different ``genie`` (a folder named ``genie`` in
the working directory, another distribution) gets a warning and is left alone: ``import torch``
never breaks because of Genie.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings


def autoload() -> None:
    """Register ``remote_accelerator`` when ``genie`` is this distribution's package."""
    here = os.path.dirname(os.path.abspath(__file__))
    mine = os.path.join(here, "genie", "__init__.py")
    mod = sys.modules.get("genie")
    try:
        spec = mod.__spec__ if mod is not None else importlib.util.find_spec("genie")
        origin = spec.origin if spec is not None else None
        if origin is None and spec is not None:  # a folder without __init__.py
            origin = ", ".join(spec.submodule_search_locations or ())
    except (ImportError, ValueError):
        origin = None
    if not origin or not os.path.isfile(origin) or not os.path.exists(mine) or \
            not os.path.samefile(origin, mine):
        warnings.warn(
            f"genie-remote-accelerator: the 'genie' Python would import ({origin}) is not the "
            f"package installed with this entry point ({mine}); remote_accelerator is not "
            "registered on 'import torch'. Rename or move that 'genie', or run from another "
            "directory.", RuntimeWarning, stacklevel=2)
        return
    import genie

    genie._autoload()
