"""The `mesh` command line: one module per subcommand, each imported only when it runs."""
