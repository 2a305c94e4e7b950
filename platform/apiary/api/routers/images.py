"""Image catalogue routes (:mod:`apiary.images.service`), under ``/api/v2/images``.

* ``GET /images?framework=&cuda=&q=&mine=``: the platform registry's images the caller may see:
  the shared ones (``apiary/...``) and their own (``users/<caller>/...``); admins every one.
* ``GET /images/{repository}`` (``repo`` or ``repo:tag``; slashes allowed): that repository's tags,
  404 for one the caller may not see.
* ``POST /images/builds?name=&tag=&shared=&description=``: the body is a tar archive of a build
  directory (any ``Content-Type``, documented as ``application/octet-stream``; gzip allowed; at most
  ``APIARY_IMAGE_BUILD_MAX_BYTES``, 413 beyond) with a ``Dockerfile`` at its top ``FROM`` the
  platform's base or a shared image (400 naming ``FROM`` otherwise). 201: the pushed image.
  ``shared=true`` (publish as ``apiary/<name>``) is for admins only (403).

Every route answers 503 when the platform runs no registry (the process runtime).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from apiary.api.auth import Users
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES
from apiary.images.service import ImageService, too_large

router = APIRouter(prefix="/api/v2/images", tags=["images"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])


async def get_images(request: Request) -> ImageService:
    return request.app.state.images


Images = Annotated[ImageService, Depends(get_images)]


class ImageJson(BaseModel):
    repository: str
    tag: str
    reference: str
    digest: str
    sizeBytes: int
    namespace: str
    owner: str | None
    labels: dict[str, str]
    title: str | None
    description: str | None
    authors: str | None
    created: str | None
    framework: str | None
    frameworkVersion: str | None
    cuda: str | None


@router.get("", response_model=list[ImageJson])
def list_images(
    images: Images, caller: Users,
    framework: str | None = Query(default=None, max_length=100, description="io.apiary.framework (any case)."),
    cuda: str | None = Query(default=None, max_length=32, description="io.apiary.cuda.version; 'none': CPU only."),
    q: str | None = Query(default=None, max_length=200, description="Words in the name, tag, title or description."),
    mine: bool = Query(default=False, description="Only the caller's own images (users/<caller>/...)."),
) -> list[dict[str, Any]]:
    """The catalogue the caller sees, sorted by repository and tag."""
    return images.list_images(caller.name, caller.admin, framework=framework, cuda=cuda, q=q, mine=mine)


@router.post("/builds", status_code=201, response_model=ImageJson,
             openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {
                 "type": "string", "format": "binary", "description": "a tar archive (gzip allowed)"}}}}})
async def build(
    request: Request, images: Images, caller: Users,
    name: str = Query(max_length=64, description="The image's name: users/<caller>/<name> (apiary/<name> shared)."),
    tag: str = Query(default="latest", max_length=128),
    shared: bool = Query(default=False, description="Publish to the shared catalogue (apiary/<name>): admins only."),
    description: str | None = Query(default=None, max_length=500,
                                    description="org.opencontainers.image.description (default: the Dockerfile's)."),
) -> dict[str, Any]:
    """Build the uploaded directory with the platform's dockerd, label it (authors: the caller) and
    push it; blocks until pushed (minutes for a large build)."""
    images.check_build(caller.name, caller.admin, name=name, tag=tag, shared=shared)  # before the body is read
    limit = request.app.state.settings.image_build_max_bytes
    fd, name_ = tempfile.mkstemp(prefix="apiary-build-upload-", suffix=".tar")  # 0600
    path = FilePath(name_)
    try:
        size = 0
        with os.fdopen(fd, "wb") as f:
            async for block in request.stream():
                size += len(block)
                if size > limit:
                    raise too_large(limit, "build directory archive")
                await run_in_threadpool(f.write, block)
        return await run_in_threadpool(images.build, caller.name, caller.admin, name=name, tag=tag, shared=shared,
                                       archive=path, description=description)
    finally:
        path.unlink(missing_ok=True)


@router.get("/{repository:path}", response_model=list[ImageJson])
def get_image(images: Images, caller: Users,
              repository: str = Path(max_length=300, description="repo or repo:tag")) -> list[dict[str, Any]]:
    """The repository's tags (one with ``:tag``); 404 for one the caller may not see."""
    return images.get(repository, caller.name, caller.admin)
