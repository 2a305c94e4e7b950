"""A Docker registry's HTTP API v2, in memory, on a loopback port: what the image catalogue reads.

:class:`FakeRegistry` serves ``/v2/``, ``/v2/_catalog`` (paginated with ``n`` / ``last`` and a
``Link: <...>; rel="next"`` header, as the distribution registry does), ``/v2/<repo>/tags/list``,
``/v2/<repo>/manifests/<tag or digest>`` (the stored media type, ``Docker-Content-Digest``; a
type the ``Accept`` header does not list is a 404 ``MANIFEST_UNKNOWN``, as the registry answers a
client that cannot read it) and ``/v2/<repo>/blobs/<digest>``. :meth:`FakeRegistry.push` stores an
image as one of four manifest kinds: Docker schema 2, OCI manifest, and each wrapped in its list
type (Docker manifest list, OCI index) with an arm64 entry first.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse
from pathlib import Path
from typing import Any

DOCKER = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
KINDS = ("docker", "oci", "docker-list", "oci-index")


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeRegistry:
    """The registry (see the module doc). ``send_digest_header``: whether manifests carry
    ``Docker-Content-Digest`` (the catalogue hashes the body without it). ``requests``: the paths
    asked, in order."""

    def __init__(self, send_digest_header: bool = True) -> None:
        self.send_digest_header = send_digest_header
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, tuple[str, bytes]] = {}  # digest -> (media type, body)
        self.tags: dict[str, dict[str, str]] = {}  # repo -> tag -> manifest digest
        self.requests: list[str] = []
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                registry.requests.append(self.path)
                status, headers, body = registry.answer(self.path, self.headers.get("Accept", ""))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self) -> FakeRegistry:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _blob(self, data: bytes) -> dict[str, Any]:
        d = _digest(data)
        self.blobs[d] = data
        return {"digest": d, "size": len(data)}

    def push(self, repository: str, tag: str, labels: dict[str, str] | None = None,
             layer_sizes: tuple[int, ...] = (1000, 2345), kind: str = "docker") -> str:
        """Store an image; returns the digest a pull by tag resolves to (the list's for list kinds).
        Its size is the config blob's plus ``layer_sizes``."""
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "config": {"Labels": labels or None, "Env": ["PATH=/usr/bin"]},
                             "rootfs": {"type": "layers", "diff_ids": []}}).encode()
        single = OCI if kind.startswith("oci") else DOCKER
        layer_type = "application/vnd.oci.image.layer.v1.tar+gzip" if single == OCI else \
            "application/vnd.docker.image.rootfs.diff.tar.gzip"
        cfg = self._blob(config)
        layers = [{"mediaType": layer_type, **self._blob(f"{repository}:{tag}:{i}".encode().ljust(n, b"x"))}
                  for i, n in enumerate(layer_sizes)]
        manifest = {"schemaVersion": 2, "mediaType": single, "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json" if single == OCI else
            "application/vnd.docker.container.image.v1+json", **cfg}, "layers": layers}
        body = json.dumps(manifest).encode()
        digest = _digest(body)
        self.manifests[digest] = (single, body)
        if kind.endswith("list") or kind.endswith("index"):
            listed = DOCKER_LIST if kind == "docker-list" else OCI_INDEX
            other = json.dumps({**manifest, "layers": layers[:1]}).encode()  # an arm64 variant, listed first
            other_digest = _digest(other)
            self.manifests[other_digest] = (single, other)
            index = {"schemaVersion": 2, "mediaType": listed, "manifests": [
                {"mediaType": single, "digest": other_digest, "size": len(other),
                 "platform": {"architecture": "arm64", "os": "linux"}},
                {"mediaType": single, "digest": digest, "size": len(body),
                 "platform": {"architecture": "amd64", "os": "linux"}}]}
            body = json.dumps(index).encode()
            digest = _digest(body)
            self.manifests[digest] = (listed, body)
        self.tags.setdefault(repository, {})[tag] = digest
        return digest

    def answer(self, raw_path: str, accept: str) -> tuple[int, dict[str, str], bytes]:
        parsed = urllib.parse.urlsplit(raw_path)
        path, query = parsed.path, urllib.parse.parse_qs(parsed.query)
        js = {"Content-Type": "application/json"}
        if path == "/v2/":
            return 200, js, b"{}"
        if path == "/v2/_catalog":
            repos = sorted(self.tags)
            last = (query.get("last") or [""])[0]
            n = int((query.get("n") or ["100"])[0])
            page = [r for r in repos if r > last][:n]
            headers = dict(js)
            if page and page[-1] != repos[-1]:
                headers["Link"] = f'</v2/_catalog?last={urllib.parse.quote(page[-1])}&n={n}>; rel="next"'
            return 200, headers, json.dumps({"repositories": page}).encode()
        for marker in ("/tags/list", "/manifests/", "/blobs/"):
            if marker in path:
                repo, _, ref = path[len("/v2/"):].partition(marker)
                break
        else:
            return 404, js, b'{"errors": [{"code": "NOT_FOUND"}]}'
        if repo not in self.tags:
            return 404, js, b'{"errors": [{"code": "NAME_UNKNOWN"}]}'
        if marker == "/tags/list":
            return 200, js, json.dumps({"name": repo, "tags": sorted(self.tags[repo])}).encode()
        if marker == "/blobs/":
            if ref not in self.blobs:
                return 404, js, b'{"errors": [{"code": "BLOB_UNKNOWN"}]}'
            return 200, {"Content-Type": "application/octet-stream"}, self.blobs[ref]
        digest = ref if ref.startswith("sha256:") else self.tags[repo].get(ref)
        if digest is None or digest not in self.manifests:
            return 404, js, b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}'
        media, body = self.manifests[digest]
        if media not in accept:
            return 404, js, b'{"errors": [{"code": "MANIFEST_UNKNOWN", "message": "not in Accept"}]}'
        headers = {"Content-Type": media}
        if self.send_digest_header:
            headers["Docker-Content-Digest"] = digest
        return 200, headers, body


class PushingBuilder:
    """An image builder (:class:`apiary.images.service.ImageBuilder`) that records each build's
    Dockerfile and files and pushes a one-layer image with the labels it is given into
    ``registry``: for tests of who may build what, without dockerd."""

    def __init__(self, registry: FakeRegistry) -> None:
        self.registry = registry
        self.dockerfiles: list[str] = []
        self.files: list[list[str]] = []

    def build(self, context: Path, image: str, labels: dict[str, str]) -> None:
        self.dockerfiles.append((context / "Dockerfile").read_text())
        self.files.append(sorted(str(p.relative_to(context)) for p in context.rglob("*")))
        repo, _, tag = image.removeprefix(f"{self.registry.address}/").rpartition(":")
        self.registry.push(repo, tag, labels, layer_sizes=(321,))

    def labels_of(self, image: str) -> dict[str, str]:
        return {}


def context_tar(dockerfile: str, files: dict[str, bytes] | None = None, *, evil: str | None = None) -> bytes:
    """A build directory as an uncompressed tar: ``Dockerfile`` and ``files``; ``evil``: one more
    member of that name (``../x``: a path out of the directory)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        members = {"Dockerfile": dockerfile.encode(), **(files or {}), **({evil: b"x"} if evil else {})}
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
