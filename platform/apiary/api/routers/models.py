"""Model registry routes (MLflow's Model Registry, :mod:`apiary.marketplace.models`), and the identity
MLflow's plugin asks for.

* ``GET /api/v2/models``: the registered models the caller may read;
* ``GET /api/v2/models/{name}``: one, with its versions;
* ``GET /api/v2/models/{name}/versions/{version}``: one version with its lineage (its run, and the
  run's ``apiary.job`` / ``apiary.attempt`` / ``apiary.task`` tags);
* ``GET /api/v2/models/{name}/versions/{version}/download``: its files as one tar
  (``application/x-tar``), paths relative to the version's source;
* ``GET /api/v2/mlflow/identity``: ``{"user", "admin", "groups"}`` of the bearer token, a user's or
  a task's MLflow secret (:mod:`apiary.marketplace.identity`): what the MLflow server's plugin asks.

The model routes forward the caller's own bearer token to MLflow, so MLflow's permissions decide:
a model the caller may not read is MLflow's 403 (or 404 when it does not exist).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from apiary.api.auth import Users, bearer
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES
from apiary.marketplace.identity import MlflowIdentity
from apiary.marketplace.models import ModelRegistry

router = APIRouter(prefix="/api/v2/models", tags=["models"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])
#: The identity route has no user dependency: a task's MLflow secret is no Apiary token.
identity_router = APIRouter(prefix="/api/v2/mlflow", tags=["models"], responses=ERROR_RESPONSES)

CHUNK_BYTES = 1 << 20


async def get_models(request: Request) -> ModelRegistry:
    return request.app.state.models


async def get_identity(request: Request) -> MlflowIdentity:
    return request.app.state.mlflow_identity


Models = Annotated[ModelRegistry, Depends(get_models)]
Identity = Annotated[MlflowIdentity, Depends(get_identity)]


def ModelName() -> Any:  # noqa: N802 - reads as a type in signatures; one FieldInfo per parameter
    return Path(pattern=r"^[^/\x00]{1,256}$", max_length=256)


def Version() -> Any:  # noqa: N802
    return Path(pattern=r"^[1-9][0-9]{0,9}$", description="A version number (1, 2, ...)")


class IdentityJson(BaseModel):
    user: str
    admin: bool
    groups: list[str]


class VersionJson(BaseModel):
    name: str
    version: str
    source: str | None = None
    runId: str | None = None
    status: str | None = None
    createdAt: str | None = None
    description: str = ""
    run: dict[str, Any] | None = None
    job: dict[str, Any] | None = None


class ModelJson(BaseModel):
    name: str
    description: str = ""
    createdAt: str | None = None
    updatedAt: str | None = None
    latestVersions: list[VersionJson] = []
    versions: list[VersionJson] | None = None


@identity_router.get("/identity", response_model=IdentityJson)
def identity(request: Request, who: Identity) -> dict:
    """Who the bearer token is: a user's token (admins are MLflow admins) or a task's MLflow secret
    of a run that is STARTING or RUNNING (its job's user, never an admin). 401 otherwise, 403 for
    an agent's or a service's token."""
    return who.of_token(bearer(request))


@router.get("", response_model=list[ModelJson])
def list_models(request: Request, models: Models, _caller: Users) -> list[dict]:
    """The registered models the caller may read (MLflow's permissions), by name."""
    return models.list(bearer(request))


@router.get("/{name}", response_model=ModelJson)
def get_model(request: Request, models: Models, _caller: Users, name: str = ModelName()) -> dict:
    """One registered model with its versions, newest first."""
    return models.get(bearer(request), name)


@router.get("/{name}/versions/{version}", response_model=VersionJson)
def get_version(request: Request, models: Models, _caller: Users, name: str = ModelName(),
                version: str = Version()) -> dict:
    """One version with its lineage: ``run`` (id, experiment, status, metrics, apiary.* tags, UI
    link; None when the caller may not read the run) and ``job`` (from the run's tags)."""
    return models.version(bearer(request), name, version)


@router.get("/{name}/versions/{version}/download", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
                             "description": "The version's files as a tar."}})
async def download(request: Request, models: Models, _caller: Users, name: str = ModelName(),
                   version: str = Version()) -> StreamingResponse:
    """The version's files as one uncompressed tar (paths relative to its source). Listing needs
    read on the version's run (its experiment), the files read on the model."""
    tar: IO[bytes] = await run_in_threadpool(models.tar, bearer(request), name, version)

    def chunks() -> Iterator[bytes]:
        try:
            while chunk := tar.read(CHUNK_BYTES):
                yield chunk
        finally:
            tar.close()

    filename = f"{name}-{version}.tar".replace('"', "")
    return StreamingResponse(chunks(), media_type="application/x-tar",
                             headers={"Content-Disposition": f'attachment; filename="{filename}"'})
