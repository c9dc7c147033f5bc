"""``python -m weightcache`` runs the CLI (weightcache/tools/cli.py)."""

from .tools.cli import main

raise SystemExit(main())
