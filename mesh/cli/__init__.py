"""The `mesh` command line: one module per subcommand, each imported only when it runs.

May import: anything of mesh/; the top of the tree.
"""
