"""The one error type the package layer raises; its message is a single line fit for a CLI."""


class PackageError(Exception):
    """A package, GGUF or range problem the user can act on."""
