"""The one base every meshpipe exception derives from.

It lives here, in a module that imports nothing, so that mesh/, stage/, packages/ and config/
can all derive from it without an import cycle. `mesh` prints any of them as one line.
"""


class MeshpipeError(Exception):
    """A meshpipe error whose message is a single line fit for a user."""
