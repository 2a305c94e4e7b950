"""Storage routes (OpenPAI's team-wise storage, :mod:`apiary.storage`), under ``/api/v2/storages``.

* ``GET /storages/servers``, ``GET|PUT|DELETE /storages/servers/{name}``: storage servers, admins
  only; an ``sshfs`` server's ``identity`` is never answered.
* ``GET /storages/configs``: the configs the caller's groups grant (admins: all);
  ``GET /storages/configs/{name}``: one, for admins and users granted it; ``PUT|DELETE``: admins.
* Files of a config, for admins and users granted it (a ``ro`` mount info: writes by admins only):
  ``GET .../{name}/list?path=`` (a directory's entries), ``GET .../{name}/files?path=`` (a file,
  streamed), ``PUT .../{name}/files?path=&overwrite=`` (the body streamed to the file, at most
  ``APIARY_STORAGE_MAX_UPLOAD_BYTES``: 413 beyond, nothing left), ``DELETE .../{name}/files?path=&recursive=``.

A config a user is not granted is a 403 naming it; one that does not exist a 404. Grants are the
groups' (``PUT|DELETE /api/v2/groups/{name}/storageConfigs/{config}``, the identity router).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from apiary.api.auth import Admin, Users
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, RequestBody
from apiary.auth import Principal
from apiary.errors import ForbiddenError, UnavailableError, ValidationError
from apiary.storage.files import StorageFiles
from apiary.storage.service import StorageService

router = APIRouter(prefix="/api/v2/storages", tags=["storage"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])

#: Bytes read from a file per chunk of a download.
CHUNK_BYTES = 1 << 20


async def get_storage(request: Request) -> StorageService:
    return request.app.state.storage


async def get_files(request: Request) -> StorageFiles:
    files = request.app.state.storage_files
    if files is None:
        raise UnavailableError("This control plane serves no storage files (no mount table was wired).")
    return files


Storage = Annotated[StorageService, Depends(get_storage)]
Files = Annotated[StorageFiles, Depends(get_files)]


def StorageName() -> Any:  # noqa: N802 - reads as a type in signatures; one FieldInfo per parameter
    return Path(pattern=r"^[A-Za-z0-9_.-]{1,100}$", max_length=100)


def FilePath() -> Any:  # noqa: N802
    return Query(default="", max_length=4096, description="Path in the config (CONFIG:PATH's PATH); '' its top.")


class ServerPut(RequestBody):
    model_config = ConfigDict(extra="forbid")
    type: Literal["local", "nfs", "glusterfs", "sshfs"]
    data: dict[str, Any] = Field(description="Connection data of the type (README, Data, models and debugging).")


class ServerJson(BaseModel):
    name: str
    type: str
    data: dict[str, Any]


class MountInfoJson(BaseModel):
    mountPoint: str
    server: str
    path: str = ""
    permission: Literal["rw", "ro"] = "rw"


class ConfigPut(RequestBody):
    model_config = ConfigDict(extra="forbid")
    default: bool = False
    mountInfos: list[dict[str, Any]] = Field(max_length=100, description="[{mountPoint, server, path, permission}]")


class ConfigJson(BaseModel):
    name: str
    default: bool
    servers: list[str]
    mountInfos: list[MountInfoJson]


class EntryJson(BaseModel):
    name: str
    type: str
    size: int
    mtime: float


class Written(BaseModel):
    path: str
    size: int


def _granted(caller: Principal, name: str) -> None:
    if not caller.may_use_storage(name):
        raise ForbiddenError(f"Storage config {name} is not granted to any of your groups; you are "
                             f"{caller.describe()}.")


@router.get("/servers", response_model=list[ServerJson])
def list_servers(storage: Storage, _caller: Admin) -> list[dict]:
    return storage.list_servers()


@router.get("/servers/{name}", response_model=ServerJson)
def get_server(storage: Storage, _caller: Admin, name: str = StorageName()) -> dict:
    return storage.get_server(name)


@router.put("/servers/{name}", response_model=ServerJson)
def put_server(body: ServerPut, storage: Storage, _caller: Admin, name: str = StorageName()) -> dict:
    """Create or replace a storage server (a 400 names the field of bad connection data)."""
    return storage.put_server(name, body.type, body.data)


@router.delete("/servers/{name}", status_code=204)
def delete_server(storage: Storage, _caller: Admin, name: str = StorageName()) -> Response:
    """Delete a server no config uses (409 otherwise)."""
    storage.delete_server(name)
    return Response(status_code=204)


@router.get("/configs", response_model=list[ConfigJson])
def list_configs(storage: Storage, caller: Users) -> list[dict]:
    """The configs the caller may use: granted to their groups (admins: every config)."""
    return storage.list_configs(None if caller.admin else caller.storage_configs)


@router.get("/configs/{name}", response_model=ConfigJson)
def get_config(storage: Storage, caller: Users, name: str = StorageName()) -> dict:
    config = storage.get_config(name)  # 404 first: an unknown config is unknown to everyone
    _granted(caller, name)
    return config


@router.put("/configs/{name}", response_model=ConfigJson)
def put_config(body: ConfigPut, storage: Storage, _caller: Admin, name: str = StorageName()) -> dict:
    """Create or replace a storage config (its servers must exist)."""
    return storage.put_config(name, default=body.default, mount_infos=body.mountInfos)


@router.delete("/configs/{name}", status_code=204)
def delete_config(storage: Storage, _caller: Admin, name: str = StorageName()) -> Response:
    """Delete a config no group is granted (409 otherwise)."""
    storage.delete_config(name)
    return Response(status_code=204)


@router.get("/configs/{name}/list", response_model=list[EntryJson])
def list_files(storage: Storage, files: Files, caller: Users, name: str = StorageName(),
               path: str = FilePath()) -> list[dict]:
    """A directory's entries (a file's own entry), ``[{name, type: file|dir|symlink, size, mtime}]``."""
    storage.config(name)
    _granted(caller, name)
    return files.list(name, path)


@router.get("/configs/{name}/files", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                 "format": "binary"}}}}})
async def download(storage: Storage, files: Files, caller: Users, name: str = StorageName(),
                   path: str = FilePath()) -> StreamingResponse:
    """A file's bytes, streamed, with its ``Content-Length``."""
    storage.config(name)
    _granted(caller, name)
    handle, size = await run_in_threadpool(files.read, name, path)

    def chunks() -> Iterator[bytes]:
        with handle:
            while block := handle.read(CHUNK_BYTES):
                yield block

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(size)})


_END = object()
_ABORT = object()


def _put(chunks: queue.Queue[Any], item: Any, done: threading.Event) -> None:
    """Hand ``item`` to the writer unless it has stopped (then the upload's rest is dropped)."""
    while not done.is_set():
        try:
            chunks.put(item, timeout=0.2)
            return
        except queue.Full:
            continue


@router.put("/configs/{name}/files", status_code=201, response_model=Written,
            openapi_extra={"requestBody": {"content": {"application/octet-stream": {"schema": {
                "type": "string", "format": "binary"}}}}})
async def upload(request: Request, storage: Storage, files: Files, caller: Users, name: str = StorageName(),
                 path: str = FilePath(), overwrite: bool = True) -> dict:
    """Write the request's body to ``path`` as it arrives (parents made; written to a temporary file
    and renamed, so a failed or oversized upload leaves nothing)."""
    storage.config(name)
    _granted(caller, name)
    chunks: queue.Queue[Any] = queue.Queue(maxsize=8)
    done = threading.Event()

    def body() -> Iterator[bytes]:
        while (item := chunks.get()) is not _END:
            if item is _ABORT:  # the client went away mid-body: the write fails and leaves nothing
                raise ValidationError("body", "the upload ended before its body did")
            yield item

    def write() -> int:
        try:
            return files.write(name, path, body(), admin=caller.admin, overwrite=overwrite)
        finally:
            done.set()

    loop = asyncio.get_running_loop()
    writing = loop.run_in_executor(None, write)
    whole = False
    try:
        async for block in request.stream():
            if done.is_set():
                break  # refused (a ro config, a bad path, over the limit): its error is raised below
            if block:
                await loop.run_in_executor(None, _put, chunks, block, done)
        whole = True
    finally:
        await loop.run_in_executor(None, _put, chunks, _END if whole else _ABORT, done)
        if not whole:  # the body failed (the request's size limit, a client gone): answer only once
            with contextlib.suppress(Exception):  # the writer removed its temporary file
                await writing
    size = await writing
    return {"path": path, "size": size}


@router.delete("/configs/{name}/files", status_code=204)
def remove(storage: Storage, files: Files, caller: Users, name: str = StorageName(), path: str = FilePath(),
           recursive: bool = False) -> Response:
    """Remove a file (a directory tree with ``recursive``)."""
    storage.config(name)
    _granted(caller, name)
    files.remove(name, path, admin=caller.admin, recursive=recursive)
    return Response(status_code=204)
