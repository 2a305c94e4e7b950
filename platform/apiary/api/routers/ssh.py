"""SSH routes (OpenPAI's ssh runtime plugin): users' public keys and a job's SSH info.

* ``/api/v2/users/{name}/sshKeys``: the public keys on a user's account (OpenPAI's user extension
  ``sshKeys``), which every task of their jobs with the ssh plugin lets in. The user themself and
  admins: list, add (``{title, value}``), remove by title (:mod:`apiary.auth.sshkeys`).
* ``GET /api/v2/jobs/{job_id}/ssh``: OpenPAI's "SSH info" of the job's current attempt, per task
  instance its host, port, login name and whether it runs, with the host public key its sshd
  presents (:meth:`apiary.control.jobssh.JobSsh.info`). The job's owner and admins; a user who may
  not see the job gets 404, as the other job routes. Private keys are never answered.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from apiary.api.auth import Caller, Dir, People
from apiary.api.deps import Plane
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, RequestBody
from apiary.auth import Principal
from apiary.control.jobssh import JobSsh
from apiary.errors import ForbiddenError, NotFoundError

router = APIRouter(prefix="/api/v2", tags=["ssh"], responses=ERROR_RESPONSES, dependencies=[Depends(plain_text)])


def PathName() -> Any:  # noqa: N802 - reads as a type in signatures; one FieldInfo per parameter
    return Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", max_length=64)


class SshKeyCreate(RequestBody):
    model_config = ConfigDict(extra="forbid")
    title: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,100}$", description="A name for the key, unique per user.")
    value: str = Field(max_length=8192, description="One public key line: '<type> <base64> [comment]'.")


class SshKeyJson(BaseModel):
    title: str
    value: str
    fingerprint: str = Field(description="OpenSSH's SHA256 fingerprint.")
    created: float


class SshTaskJson(BaseModel):
    taskRole: str
    index: int
    node: str | None
    host: str | None = Field(description="The node's reported address; null while unplaced.")
    port: int | None = Field(description="The instance's ssh port; null without the ssh plugin or a run.")
    running: bool
    state: str


class SshInfo(BaseModel):
    jobId: str
    login: str = Field(description="The user name every instance's sshd lets in.")
    hostKeyAlias: str = Field(description="The name the host key is known under (ssh's HostKeyAlias).")
    hostPublicKey: str | None = Field(description="The host key every instance presents; null before any launch.")
    tasks: list[SshTaskJson]


def _self_or_admin(caller: Principal, name: str, what: str) -> None:
    if not (caller.admin or (caller.kind == "user" and caller.name == name)):
        raise ForbiddenError(f"Only {name} and admins may {what} {name}'s SSH keys; you are {caller.describe()}.")


@router.get("/users/{name}/sshKeys", response_model=list[SshKeyJson])
def list_ssh_keys(directory: Dir, caller: Caller, name: str = PathName()) -> list[dict]:
    """The public keys on ``name``'s account, by title."""
    _self_or_admin(caller, name, "read")
    return directory.ssh_keys.list(name)


@router.post("/users/{name}/sshKeys", status_code=201, response_model=SshKeyJson)
def add_ssh_key(body: SshKeyCreate, directory: Dir, caller: Caller, name: str = PathName()) -> dict:
    """Keep a public key on ``name``'s account: tasks of their jobs with the ssh plugin launched from
    now on let it in. 409 for a title or key already there."""
    _self_or_admin(caller, name, "change")
    return directory.ssh_keys.add(name, body.title, body.value)


@router.delete("/users/{name}/sshKeys/{title}", status_code=204, response_class=Response)
def remove_ssh_key(directory: Dir, caller: Caller, name: str = PathName(),
                   title: str = Path(pattern=r"^[A-Za-z0-9_.@-]{1,100}$", max_length=100)) -> Response:
    """Remove a key; tasks launched from now on no longer let it in (running ones keep it)."""
    _self_or_admin(caller, name, "change")
    directory.ssh_keys.remove(name, title)
    return Response(status_code=204)


@router.get("/jobs/{job_id}/ssh", response_model=SshInfo)
def ssh_info(job_id: str, plane: Plane, caller: People) -> dict:
    """OpenPAI's SSH info: how to reach each task instance of the job's current attempt."""
    user, vc = plane.job_owner(job_id)
    if not caller.may_see(user, vc):
        raise NotFoundError(f"Job {job_id} not found.")
    if not (caller.admin or (caller.kind == "user" and caller.name == user)):
        raise ForbiddenError(f"Only {user} and admins may read the SSH info of job {job_id}; "
                             f"you are {caller.describe()}.")
    return JobSsh(plane.cache.sessions).info(job_id, plane.cache.spec_of)
