"""``python -m genie.server``: the Genie server (same as the ``genie-server`` console script).

See :mod:`genie.remote.server` and docs/deployment.md.
"""

from .remote.server import main

if __name__ == "__main__":
    raise SystemExit(main())
