"""``python -m weightcache`` runs the CLI."""

from .cli import main

raise SystemExit(main())
