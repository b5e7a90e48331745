"""`python -m mesh.cli`: the `mesh` command, as stages spawned by a coordinator run it."""

from mesh.cli.main import main

raise SystemExit(main())
