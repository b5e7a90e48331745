"""A tiny in-memory stand-in for huggingface.co, for tests only. It is not the Hub.

No Hub is reachable from CI, so the publish tests point the real `huggingface_hub.HfApi` at this
server (HF_ENDPOINT or HfApi(endpoint=...)) and let it run its real HTTP upload path. The server
implements only the endpoints that path calls, with the request and response shapes
huggingface_hub expects:

    POST /api/repos/create                              create_repo
    POST /api/models/{org}/{name}/branch/{branch}       create_branch
    GET  /api/models/{org}/{name}                       repo_info, which create_repo(exist_ok=True) calls on 401/403
    HEAD /{org}/{name}/resolve/{rev}/{path}             file_exists (metadata only: files are never served)
    POST /api/validate-yaml                             create_commit's README.md check
    POST /api/models/{org}/{name}/preupload/{rev}       create_commit: regular or LFS per file
    POST /{org}/{name}.git/info/lfs/objects/batch       LFS batch API, "basic" transfer
    PUT  /lfs/{oid}   POST /lfs/{oid}/verify            LFS upload and verify
    POST /api/models/{org}/{name}/commit/{rev}          create_commit (ndjson)
    GET  /api/agent-harnesses                           huggingface_hub's user-agent lookup: empty

Xet storage is not implemented: clients must run with HF_HUB_DISABLE_XET=1, which makes
huggingface_hub take its legacy LFS path. Tokens in `write_tokens` may write, tokens in
`read_tokens` get 403 on writes, and a request without a token gets 401. Every file that lands
is logged in order in `events`, and every request in `requests`; `fail_commits_with` makes a
commit fail as if the Hub broke half way through a publish.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

_REGULAR_LIMIT = 10 * 1024 * 1024


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        """What the Hub reports as a file's oid: sha256 for LFS files, git blob sha1 otherwise."""
        if self.lfs:
            return hashlib.sha256(self.data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass(frozen=True)
class Commit:
    oid: str
    message: str
    tree: dict[str, Blob]
    changes: tuple[tuple[str, str], ...]  # ("add" | "delete", path) in payload order


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    def head(self, rev: str) -> Commit | None:
        oid = self.branches.get(rev, rev)
        return self.commits.get(oid)


class FakeHub:
    def __init__(self, write_tokens: tuple[str, ...] = ("hf_write",),
                 read_tokens: tuple[str, ...] = ("hf_read",)) -> None:
        self.write_tokens, self.read_tokens = set(write_tokens), set(read_tokens)
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.events: list[tuple[str, str]] = []  # ("put", oid) | ("add"|"delete", path) | ("commit", oid)
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.fail_commits_with: set[str] = set()  # a commit touching one of these paths gets a 500
        self.lock = threading.Lock()
        self.url = ""
        self._commits = 0

    def commits(self, repo_id: str, branch: str = "main") -> list[Commit]:
        """The branch's history, oldest first (the repo's initial commit included)."""
        repo = self.repos[repo_id]
        return [c for c in repo.commits.values() if _reachable(repo, branch, c.oid)]

    def new_commit(self, repo: Repo, branch: str, message: str, tree: dict[str, Blob],
                   changes: tuple[tuple[str, str], ...]) -> Commit:
        self._commits += 1
        oid = hashlib.sha1(f"{self._commits}:{message}:{sorted(tree)}".encode()).hexdigest()
        commit = Commit(oid, message, tree, changes)
        repo.commits[oid] = commit
        repo.branches[branch] = oid
        self.events.append(("commit", oid))
        return commit


def _reachable(repo: Repo, branch: str, oid: str) -> bool:
    # Commits are never rewritten here, so a branch holds every commit made on it or before it forked.
    head = repo.branches.get(branch)
    return head is not None and list(repo.commits).index(oid) <= list(repo.commits).index(head)


@contextlib.contextmanager
def running_hub(**kwargs: Any) -> Iterator[FakeHub]:
    hub = FakeHub(**kwargs)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


class _Reply(Exception):
    """Raised by a route to answer with a status, a JSON body and headers."""

    def __init__(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers or {}


_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"/api/repos/create"), "create_repo"),
    ("POST", re.compile(rf"/api/models/{_REPO}/branch/(?P<rev>.+)"), "create_branch"),
    ("GET", re.compile(rf"/api/models/{_REPO}"), "repo_info"),
    ("HEAD", re.compile(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), "head_file"),
    ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
    ("POST", re.compile(rf"/api/models/{_REPO}/preupload/(?P<rev>.+)"), "preupload"),
    ("POST", re.compile(rf"/{_REPO}\.git/info/lfs/objects/batch"), "lfs_batch"),
    ("PUT", re.compile(r"/lfs/(?P<oid>[0-9a-f]{64})"), "lfs_put"),
    ("POST", re.compile(r"/lfs/(?P<oid>[0-9a-f]{64})/verify"), "lfs_verify"),
    ("POST", re.compile(rf"/api/models/{_REPO}/commit/(?P<rev>.+)"), "commit"),
    ("GET", re.compile(r"/api/agent-harnesses"), "agent_harnesses"),
]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def do_GET(self) -> None:
            self._dispatch("GET")

        def _dispatch(self, method: str) -> None:
            path = urlsplit(self.path).path
            body = self._body()
            with hub.lock:
                hub.requests.append((method, path))
                try:
                    for verb, pattern, name in _ROUTES:
                        match = pattern.fullmatch(path)
                        if verb == method and match:
                            params = {k: unquote(v) for k, v in match.groupdict().items()}
                            getattr(_Routes(hub, self, body), name)(**params)
                    hub.unhandled.append((method, path))
                    raise _Reply(404, {"error": f"the test hub does not implement {method} {path}"})
                except _Reply as reply:
                    self._send(method, reply)

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, method: str, reply: _Reply) -> None:
            data = b"" if reply.body is None else json.dumps(reply.body).encode()
            self.send_response(reply.status)
            headers = {"Content-Type": "application/json", "Content-Length": str(len(data)), **reply.headers}
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(data)

    return Handler


# The lookups that need no hub state are plain functions, so _Routes holds its endpoints and little else.


def _token(request: BaseHTTPRequestHandler) -> str | None:
    auth = request.headers.get("Authorization", "")
    return auth.removeprefix("Bearer ").strip() or None


def _head(repo: Repo, rev: str) -> Commit:
    """The commit `rev` names, or the Hub's 404 for an unknown revision."""
    commit = repo.head(rev)
    if commit is None:
        raise _Reply(404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
    return commit


class _Routes:
    """One request's handling; every method ends by raising _Reply."""

    def __init__(self, hub: FakeHub, request: BaseHTTPRequestHandler, body: bytes) -> None:
        self.hub, self.request, self.body = hub, request, body

    # -- auth and lookups ---------------------------------------------------------------------------

    def _require_write(self) -> None:
        token = _token(self.request)
        if token is None or token not in self.hub.write_tokens | self.hub.read_tokens:
            raise _Reply(401, {"error": "Invalid credentials in Authorization header"},
                         {"X-Error-Message": "Invalid credentials in Authorization header"})
        if token not in self.hub.write_tokens:
            message = "You don't have the rights to write to this repository"
            raise _Reply(403, {"error": message}, {"X-Error-Message": message})

    def _repo(self, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and _token(self.request) not in self.hub.write_tokens | self.hub.read_tokens):
            raise _Reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        return repo

    def _json(self) -> Any:
        return json.loads(self.body or b"{}")

    # -- endpoints ----------------------------------------------------------------------------------

    def create_repo(self) -> None:
        self._require_write()
        payload = self._json()
        repo_id = f"{payload.get('organization')}/{payload['name']}"
        if repo_id in self.hub.repos:
            raise _Reply(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"})
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = self.hub.repos[repo_id] = Repo(private=private)
        attributes = Blob(b"*.gguf filter=lfs diff=lfs merge=lfs -text\n", lfs=False)
        self.hub.new_commit(repo, "main", "initial commit", {".gitattributes": attributes}, ())
        raise _Reply(200, {"url": f"{self.hub.url}/{repo_id}"})

    def create_branch(self, repo: str, rev: str) -> None:
        self._require_write()
        target = self._repo(repo)
        if rev in target.branches:
            raise _Reply(409, {"error": "Reference already exists"})
        start = self._json().get("startingPoint") or "main"
        target.branches[rev] = _head(target, start).oid
        raise _Reply(200, {})

    def repo_info(self, repo: str) -> None:
        target = self._repo(repo)
        head = _head(target, "main")
        raise _Reply(200, {"id": repo, "sha": head.oid, "private": target.private,
                           "siblings": [{"rfilename": path} for path in sorted(head.tree)]})

    def head_file(self, repo: str, rev: str, path: str) -> None:
        commit = _head(self._repo(repo), rev)
        blob = commit.tree.get(path)
        if blob is None:
            raise _Reply(404, None, {"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{blob.oid}"', "Content-Length": str(len(blob.data))}
        if blob.lfs:
            headers |= {"X-Linked-Etag": f'"{blob.oid}"', "X-Linked-Size": str(len(blob.data))}
        raise _Reply(200, None, headers)

    def validate_yaml(self) -> None:
        raise _Reply(200, {"errors": [], "warnings": []})

    def preupload(self, repo: str, rev: str) -> None:
        self._require_write()
        tree = _head(self._repo(repo), rev).tree
        files = []
        for f in self._json()["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith(".gguf") or b"\0" in sample or f["size"] > _REGULAR_LIMIT
            existing = tree.get(f["path"])
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": False, "oid": existing.oid if existing else None})
        raise _Reply(200, {"files": files})

    def lfs_batch(self, repo: str) -> None:
        self._require_write()
        self._repo(repo)
        objects = []
        for obj in self._json()["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.hub.lfs:  # already stored: the client skips the upload
                base = f"{self.hub.url}/lfs/{obj['oid']}"
                entry["actions"] = {"upload": {"href": base, "header": {}},
                                    "verify": {"href": f"{base}/verify", "header": {}}}
            objects.append(entry)
        raise _Reply(200, {"transfer": "basic", "objects": objects})

    def lfs_put(self, oid: str) -> None:
        if hashlib.sha256(self.body).hexdigest() != oid:
            raise _Reply(400, {"error": "sha256 of the uploaded bytes does not match the oid"})
        self.hub.lfs[oid] = self.body
        self.hub.events.append(("put", oid))
        raise _Reply(200, {})

    def lfs_verify(self, oid: str) -> None:
        if oid not in self.hub.lfs:
            raise _Reply(404, {"error": "object not uploaded"})
        raise _Reply(200, {})

    def agent_harnesses(self) -> None:
        raise _Reply(200, {"standardEnvVars": [], "harnesses": {}})

    def commit(self, repo: str, rev: str) -> None:
        self._require_write()
        target = self._repo(repo)
        tree = dict(_head(target, rev).tree)
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        if any(line["value"].get("path") in self.hub.fail_commits_with for line in lines):
            raise _Reply(500, {"error": "Internal Error (injected by the test)"})
        changes = []
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                tree[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                if value["oid"] not in self.hub.lfs:
                    raise _Reply(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                tree[value["path"]] = Blob(self.hub.lfs[value["oid"]], lfs=True)
            elif key == "deletedFile":
                if tree.pop(value["path"], None) is None:
                    raise _Reply(404, {"error": "A file with this name doesn't exist"},
                                 {"X-Error-Code": "EntryNotFound"})
            else:
                continue
            changes.append(("delete" if key == "deletedFile" else "add", value["path"]))
        self.hub.events.extend(changes)
        commit = self.hub.new_commit(target, rev, header["summary"], tree, tuple(changes))
        raise _Reply(200, {"commitOid": commit.oid, "commitUrl": f"{self.hub.url}/{repo}/commit/{commit.oid}",
                           "pullRequestUrl": None})
