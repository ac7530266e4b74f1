"""`python -m ptrres`: the same as the `ptrres` command."""

from ._cli import main

raise SystemExit(main())
