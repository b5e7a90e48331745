"""Ranges of a file's bytes on the Hugging Face Hub, by HTTP range request.

`mesh plan` needs a GGUF's header, a few MiB at the front of a file of hundreds of GB, so it
asks for those bytes alone. huggingface_hub's own URL, session and headers carry the
endpoint (HF_ENDPOINT), the token (HF_TOKEN or `hf auth login`) and its proxies; the Hub
answers a `resolve` URL with a redirect to its storage, which honours the range.
"""

from __future__ import annotations

from huggingface_hub import constants, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from packages.errors import PackageError
from packages.gguf_infos import ReadRange
from packages.hub import HUB_ERRORS, explain
from packages.refs import HubRef


def range_reader(ref: HubRef) -> ReadRange:
    """A reader of byte ranges of the file `ref` names; Hub errors become PackageErrors."""
    if ref.path is None:
        raise PackageError(f"{ref} names no file: give hf://org/repo@rev/file.gguf")
    path = ref.path
    url = hf_hub_url(ref.repo_id, path, revision=ref.rev, endpoint=constants.ENDPOINT)

    def read(start: int, end: int) -> bytes:
        headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"}
        try:
            response = get_session().get(url, headers=headers, follow_redirects=True)
            if response.status_code == 416:  # asked past the end of the file
                return b""
            hf_raise_for_status(response)
        except HUB_ERRORS as exc:
            raise PackageError(explain(exc, ref.package(), path)) from None
        body = response.content
        # a server that ignores Range sends the whole file (200): keep the range asked
        return body[start:end] if response.status_code == 200 else body

    return read
