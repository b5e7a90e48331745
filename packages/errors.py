"""The one error type the package layer raises; its message is a single line fit for a CLI."""

from config.errors import MeshpipeError


class PackageError(MeshpipeError):
    """A package, GGUF or range problem the user can act on."""
