"""``python -m router`` (and the ``session-router`` console script): see ``router.cli``."""

from router.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
