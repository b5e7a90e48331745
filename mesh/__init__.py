"""The coordinator and CLI: `mesh serve`, `mesh stage`, `mesh package …`, `mesh status`, `mesh bench`."""
