"""``python -m headmech.cli``: the ``headmech`` command."""

from headmech.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
