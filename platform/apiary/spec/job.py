"""OpenPAI job protocol v2 as pydantic models, validated the way OpenPAI's REST server does.

Sources of the rules (cited per field below):

* ``schema``: /work/shared/reference/openpai/openpai-protocol-schema-v2.yaml, the written
  OpenAPI 3 schema of microsoft/openpai-protocol;
* ``rest-server``: OpenPAI's REST server, ``src/config/v2/protocol.js`` (the ajv schema it
  enforces), ``src/middlewares/v2/protocol.js`` (cross-reference checks: prerequisites and
  deployments named by task roles and defaults must exist) and ``src/config/v2/hived.js``
  (``extras.hivedScheduler``), ``src/models/v2/job/k8s.js`` (priority classes).

Wire names are camelCase (aliases); Python attributes are snake_case. Every object rejects
unknown fields except those the protocol leaves free-form: ``parameters``, ``secrets``,
``extras`` (apart from its typed keys) and script/output/data prerequisites.

Entry point: :func:`parse_job` (YAML or JSON text -> :class:`JobSpec`); every failure is an
:class:`apiary.errors.ValidationError` whose ``field`` is the dotted path of the first bad field.
The text is read with :func:`apiary.spec.safeyaml.load` (bounded depth, aliases and size, no
duplicate keys), and the protocol's integers have upper bounds of Apiary's (``MAX_*`` below),
since OpenPAI's schema leaves them open.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from apiary.errors import ValidationError
from apiary.spec import admission, safeyaml
from apiary.spec.probes import validate_probes
from apiary.spec.ssh import SSH_PORT_NAME, SshPlugin, ssh_plugins
from apiary.spec.storage import StorageRequest, storage_requests
from apiary.spec.suggest import did_you_mean, field_names_at
from apiary.spec.templating import render, rendered_size
from apiary.spec.tensorboard import PORT_NAME as TENSORBOARD_PORT_NAME
from apiary.spec.tensorboard import TensorBoardPlugin, tensorboard_plugin

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_JOB_INSTANCES",
    "MAX_CPU",
    "MAX_GPU",
    "MAX_INSTANCES",
    "MAX_MEMORY_MB",
    "MAX_PORTS",
    "MAX_RETRY_COUNT",
    "PRIORITY_CLASSES",
    "DataPrerequisite",
    "Defaults",
    "Deployment",
    "DeploymentTaskRole",
    "DockerImageAuth",
    "DockerImagePrerequisite",
    "Extras",
    "ExtraContainerOptions",
    "HivedScheduler",
    "HivedTaskRole",
    "JobSpec",
    "Prerequisite",
    "ResourcePerInstance",
    "ScriptOrOutputPrerequisite",
    "TaskRole",
    "TaskRoleCompletion",
    "parse_job",
]

#: Priority class -> HiveD priority, as OpenPAI's REST server maps it (rest-server
#: ``convertPriority`` in src/models/v2/job/k8s.js; HiveD's allowed range is [-1, 126]).
#: -1 is HiveD's opportunistic priority: the job may use idle cells outside its VC's quota
#: and is preempted by any guaranteed job.
PRIORITY_CLASSES: dict[str, int] = {"crit": 120, "prod": 100, "test": 10, "oppo": -1}

#: Default priority class when a job names none (rest-server ``convertPriority(priorityClass='test')``).
DEFAULT_PRIORITY_CLASS: Literal["test"] = "test"
#: Virtual cluster a job without ``defaults.virtualCluster`` is submitted to (OpenPAI's default VC).
DEFAULT_VIRTUAL_CLUSTER = "default"

#: Job, prerequisite and deployment names: schema ``PrerequisiteInfo.name`` and rest-server base.json.
#: Given to pydantic's ``pattern``, which matches with Rust's regex engine: there ``$`` is the end of
#: the text only, so ``"train\n"`` does not match (Python's ``re.match`` with ``$`` would let it by).
NAME_PATTERN = r"^[a-zA-Z0-9_-]+$"
NAME_MAX_LENGTH = 255
#: Task role and port label names: "valid C variable name" (schema ``taskRoles`` and ``ports``;
#: rest-server ``patternProperties``). The task role name becomes part of environment variable
#: names such as ``PAI_TASK_ROLE_<name>_HOST_LIST``, hence no dashes.
IDENTIFIER_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
#: Matched with ``fullmatch``: ``re.match`` with ``$`` accepts one trailing newline, and a task role
#: ``"train\n"`` would reach a node agent as part of an environment variable's name.
_IDENTIFIER_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_LEGACY_IDENTIFIER_RE = re.compile(IDENTIFIER_PATTERN)  # the rule jobs stored before fullmatch were accepted under

_PREREQUISITE_TYPES = ("dockerimage", "script", "output", "data")

# --------------------------------------------------------------------------- Apiary's bounds
# OpenPAI's schema and rest-server type the protocol's counts and sizes as integers with at most
# a minimum. Unbounded, a typo or a hostile spec (``jobRetryCount: 10**30``, ``memoryMB: 10**30``)
# reaches the scheduler, the store and the messages about it. These maxima are Apiary's own:
# each is far above any real job, and a value over it is rejected with the field's dotted path.

#: ``jobRetryCount`` and ``taskRetryCount``: a job retried more than 100 times is broken, not
#: unlucky (OpenPAI's examples use 0 to 3).
MAX_RETRY_COUNT = 100
#: ``instances`` of one task role: one instance is one pod, and Kubernetes' documented
#: large-cluster limit is 150,000 pods in all (kubernetes.io "Considerations for large
#: clusters"), so no cluster could run more. The per-job policy limit is ``parse_job``'s
#: ``max_instances`` (default :data:`DEFAULT_MAX_JOB_INSTANCES`), far lower.
MAX_INSTANCES = 150_000
#: Default of ``parse_job(max_instances=...)``: instances of one job, all task roles together.
#: The control plane passes its configured value (``APIARY_MAX_INSTANCES``); 1,000 is its default.
DEFAULT_MAX_JOB_INSTANCES = 1000
#: ``resourcePerInstance.cpu`` (vcores) and ``.memoryMB`` (MiB, here 64 TiB): twice the largest
#: single machines offered today (AWS u7in-32tb.224xlarge: 896 vCPUs, 32 TiB), rounded up to a
#: power of two. Also bounds ``extraContainerOptions.shmMB``, which lives in the same memory.
MAX_CPU = 1024
MAX_MEMORY_MB = 64 * 2**20
#: ``resourcePerInstance.gpu``: machines carry 8 or 16 GPUs; 1,024 leaves two orders of magnitude.
MAX_GPU = 1024
#: ``resourcePerInstance.ports``: ports one instance reserves, all labels together (each label
#: is a few ports: ssh, http, a rendezvous port; every one is taken from the node's host ports).
MAX_PORTS = 100


# --------------------------------------------------------------------------- shared pieces


class _Model(BaseModel):
    # strict: OpenPAI's ajv schema does not coerce ("2" is no integer, "yes" no boolean);
    # YAML already yields native ints, bools and strings.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class _OpenModel(_Model):
    """An object the protocol lets carry fields of its own (``additionalProperties: true``)."""

    model_config = ConfigDict(extra="allow")


def _field_info(model: type[BaseModel], info: pydantic.ValidationInfo) -> FieldInfo:
    """The field a field validator is validating (pydantic always names it for field validators)."""
    if info.field_name is None:
        raise TypeError(f"{model.__name__}: a field validator called without a field name")
    return model.model_fields[info.field_name]


def _stored(info: pydantic.ValidationInfo) -> bool:
    """Whether the job is being reloaded from the store (``parse_job(..., stored=True)``)."""
    return bool(info.context and info.context.get("stored"))


def _check_identifier(kind: str) -> pydantic.AfterValidator:
    def check(name: str, info: pydantic.ValidationInfo) -> str:
        # A stored job is held to the rule it was accepted under (re.match: one trailing newline).
        accepted = _LEGACY_IDENTIFIER_RE.match(name) if _stored(info) else _IDENTIFIER_RE.fullmatch(name)
        if not accepted:
            raise PydanticCustomError(
                "openpai_identifier",
                "{kind} name {name} is not allowed: OpenPAI requires ^[a-zA-Z_][a-zA-Z0-9_]*$ "
                "(a valid C variable name: letters, digits, underscores, not starting with a digit)",
                {"kind": kind, "name": _brief(name)},
            )
        return name

    return pydantic.AfterValidator(check)


TaskRoleName = Annotated[str, _check_identifier("task role")]
PortLabel = Annotated[str, _check_identifier("port label")]
Name = Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=NAME_MAX_LENGTH)]
NonNegativeInt = Annotated[int, Field(ge=0)]
RetryCount = Annotated[int, Field(ge=0, le=MAX_RETRY_COUNT)]
#: rest-server base.json: ``version: {type: ['string', 'number']}``.
Version = str | int | float


def _protocol_version(value: Any, info: pydantic.ValidationInfo) -> Any:
    # schema: protocolVersion is the number 2 or the string "2"; normalised to the int 2. The
    # number is taken as the integer 2 only: 2.0 and True (which Python's == would let pass as
    # Literal[2], 2.0 == 2) are refused; a job stored before that rule still reloads.
    if (value == "2" and isinstance(value, str)) or (type(value) is int and value == 2):
        return 2
    if _stored(info) and type(value) is float and value == 2:
        return 2
    raise PydanticCustomError(
        "openpai_protocol_version",
        'protocol version must be the integer 2 (or the string "2", as OpenPAI\'s schema allows), got {value}',
        {"value": _brief(value)},
    )


ProtocolVersion = Annotated[Literal[2], pydantic.BeforeValidator(_protocol_version)]


# --------------------------------------------------------------------------- prerequisites


class _PrerequisiteInfo(_Model):
    """Fields every prerequisite shares (schema ``PrerequisiteInfo``)."""

    protocol_version: ProtocolVersion | None = Field(None, alias="protocolVersion")
    name: Name
    version: Version | None = None
    contributor: str | None = None
    description: str | None = None


class DockerImageAuth(_Model):
    """Registry credentials. ``password`` should be a ``<% $secrets.x %>`` reference (schema)."""

    username: str | None = None
    password: str | None = None
    registryuri: str | None = None


class DockerImagePrerequisite(_PrerequisiteInfo):
    """``type: dockerimage``: ``uri`` is the image reference (``openpai/pai.example.pytorch``).

    Closed object (rest-server: ``additionalProperties: false``); ``uri`` is required.
    """

    type: Literal["dockerimage"]
    uri: str
    auth: DockerImageAuth | None = None


class ScriptOrOutputPrerequisite(_PrerequisiteInfo):
    """``type: script`` or ``type: output``: ``uri`` is one location string. Open object (schema)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["script", "output"]
    plugin: str | None = None
    require: list[str] | None = None
    uri: str | None = None


class DataPrerequisite(_PrerequisiteInfo):
    """``type: data``: ``uri`` is a non-empty list of locations (schema ``minItems: 1``). Open object."""

    model_config = ConfigDict(extra="allow")

    type: Literal["data"]
    plugin: str | None = None
    require: list[str] | None = None
    uri: Annotated[list[str], Field(min_length=1)] | None = None


Prerequisite = Annotated[
    DockerImagePrerequisite | ScriptOrOutputPrerequisite | DataPrerequisite,
    Field(discriminator="type"),
]


# --------------------------------------------------------------------------- task roles


class TaskRoleCompletion(_Model):
    """When a task role's instances decide the job's outcome (schema ``completion``; OpenPAI
    passes them to FrameworkController as ``minFailedTaskCount`` / ``minSucceededTaskCount``).

    * ``minFailedInstances`` (default 1, schema): the job fails as soon as this many instances
      of the role have failed (after their ``taskRetryCount`` retries). ``-1``: instance
      failures never fail the job.
    * ``minSucceededInstances`` (default -1): the job succeeds as soon as this many instances
      have succeeded. ``-1``: only once *all* instances have completed and
      ``minFailedInstances`` was not reached, which is what the schema's "default is task
      instances" amounts to.

    Each is ``-1`` or ``>= 1``; ``null`` (allowed by the rest-server schema) means the default.
    """

    # le: a count above MAX_INSTANCES could never be reached (Apiary's bound, like the others).
    min_failed_instances: int = Field(1, alias="minFailedInstances", le=MAX_INSTANCES)
    min_succeeded_instances: int = Field(-1, alias="minSucceededInstances", le=MAX_INSTANCES)

    @field_validator("min_failed_instances", "min_succeeded_instances", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        if value is None:
            return _field_info(cls, info).default
        return value

    @field_validator("min_failed_instances", "min_succeeded_instances")
    @classmethod
    def _minus_one_or_positive(cls, value: int, info: pydantic.ValidationInfo) -> int:
        # schema: "-1 or no less than 1"; 0 would decide the job before any instance ran.
        if value != -1 and value < 1:
            raise PydanticCustomError(
                "openpai_completion",
                "{field} must be -1 or at least 1, got {value}",
                {"field": _field_info(cls, info).alias, "value": value},
            )
        return value


class ExtraContainerOptions(_Model):
    """Docker options (schema): ``shmMB`` is the size of /dev/shm in MiB; ``infiniband`` mounts IB devices."""

    shm_mb: Annotated[int, Field(ge=0, le=MAX_MEMORY_MB)] | None = Field(None, alias="shmMB")
    infiniband: bool | None = None


class ResourcePerInstance(_Model):
    """Resources of one instance (one container).

    ``cpu`` in vcores, ``memoryMB`` in MiB, ``gpu`` in whole cards; all three are required
    (rest-server). ``0 <= gpu <= MAX_GPU``, ``1 <= cpu <= MAX_CPU`` and ``1 <= memoryMB <=
    MAX_MEMORY_MB`` are Apiary's bounds (OpenPAI only types them as integers; a negative request
    is meaningless to HiveD). ``ports`` maps a port label (C identifier) to how many ports to
    reserve (host network only; schema), at most :data:`MAX_PORTS` in all.
    """

    cpu: Annotated[int, Field(ge=1, le=MAX_CPU)]
    memory_mb: Annotated[int, Field(ge=1, le=MAX_MEMORY_MB)] = Field(alias="memoryMB")
    gpu: Annotated[int, Field(ge=0, le=MAX_GPU)]
    ports: Annotated[dict[PortLabel, Annotated[int, Field(ge=0, le=MAX_PORTS)]], Field(min_length=1)] | None = None

    @field_validator("ports")
    @classmethod
    def _ports_in_all(cls, ports: dict[str, int] | None) -> dict[str, int] | None:
        total = sum((ports or {}).values())
        if total > MAX_PORTS:
            raise PydanticCustomError(
                "apiary_ports",
                "asks for {total} ports in all labels, more than Apiary's maximum of {max} per instance",
                {"total": total, "max": MAX_PORTS},
            )
        return ports


class TaskRole(_Model):
    """One kind of task; ``instances`` copies of it run, each in its own container.

    Rules: ``1 <= instances <= MAX_INSTANCES`` (default 1), ``0 <= taskRetryCount <=
    MAX_RETRY_COUNT`` (default 0; the maxima are Apiary's), ``dockerImage``
    names a ``dockerimage`` prerequisite, ``data``/``output``/``script`` name a prerequisite of
    that type, ``prerequisites`` name existing prerequisites (rest-server middleware), and
    ``commands`` is a non-empty list of shell lines (rest-server ``minItems: 1``).
    """

    protocol_version: ProtocolVersion | None = Field(None, alias="protocolVersion")
    instances: Annotated[int, Field(ge=1, le=MAX_INSTANCES)] = 1
    completion: TaskRoleCompletion = Field(default_factory=TaskRoleCompletion)
    task_retry_count: RetryCount = Field(0, alias="taskRetryCount")
    prerequisites: list[str] | None = None
    docker_image: str = Field(alias="dockerImage")
    data: str | None = None
    output: str | None = None
    script: str | None = None
    extra_container_options: ExtraContainerOptions | None = Field(None, alias="extraContainerOptions")
    resource_per_instance: ResourcePerInstance = Field(alias="resourcePerInstance")
    commands: Annotated[list[str], Field(min_length=1)]


# --------------------------------------------------------------------------- deployments, defaults


class DeploymentTaskRole(_Model):
    """Commands a deployment wraps around one task role's ``commands`` (each list non-empty if given)."""

    pre_commands: Annotated[list[str], Field(min_length=1)] | None = Field(None, alias="preCommands")
    post_commands: Annotated[list[str], Field(min_length=1)] | None = Field(None, alias="postCommands")


class Deployment(_Model):
    """A named deployment; its ``taskRoles`` keys must be task roles of the job (schema)."""

    protocol_version: ProtocolVersion | None = Field(None, alias="protocolVersion")
    name: Name
    task_roles: Annotated[dict[TaskRoleName, DeploymentTaskRole], Field(min_length=1)] = Field(
        alias="taskRoles"
    )


class Defaults(_Model):
    """Submission defaults: ``virtualCluster`` (VC name) and ``deployment`` (a deployment's name)."""

    virtual_cluster: str | None = Field(None, alias="virtualCluster")
    deployment: str | None = None


# --------------------------------------------------------------------------- extras


class HivedTaskRole(_Model):
    """Per-task-role HiveD placement (rest-server hived.js; closed object).

    ``skuType``: the leaf cell type (GPU model) to run on; ``pinnedCellId``: a pinned cell of
    the VC to run in; ``affinityGroupName``: task roles sharing a name are gang-placed together.
    """

    sku_type: str | None = Field(None, alias="skuType")
    pinned_cell_id: str | None = Field(None, alias="pinnedCellId")
    affinity_group_name: str | None = Field(None, alias="affinityGroupName")


class HivedScheduler(_Model):
    """``extras.hivedScheduler``: ``jobPriorityClass`` is crit/prod/test/oppo (default test)."""

    job_priority_class: Literal["crit", "prod", "test", "oppo"] = Field(
        DEFAULT_PRIORITY_CLASS, alias="jobPriorityClass"
    )
    task_roles: dict[TaskRoleName, HivedTaskRole] | None = Field(None, alias="taskRoles")


class Extras(_OpenModel):
    """Free-form plugin data (schema ``extras``) with two typed keys.

    ``gangAllocation`` (default true): all instances of the job are placed at once or not at
    all. ``hivedScheduler``: see :class:`HivedScheduler`. Other keys are kept as given.
    """

    gang_allocation: bool = Field(True, alias="gangAllocation")
    hived_scheduler: HivedScheduler | None = Field(None, alias="hivedScheduler")


# --------------------------------------------------------------------------- the job


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (folded commands) as readable ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


class JobSpec(_Model):
    """An OpenPAI job protocol v2 document (schema ``JobProtocol``).

    Required: ``protocolVersion`` (2 or "2"), ``name`` (``^[a-zA-Z0-9_-]+$``, <= 255 chars),
    ``type: job``, ``taskRoles`` (at least one). ``jobRetryCount`` defaults to 0 (at most
    :data:`MAX_RETRY_COUNT`, Apiary's bound).
    ``prerequisites`` is optional to the rest-server schema but in practice required, since
    every task role's ``dockerImage`` must name one.

    Cross-field rules (rest-server middleware and hived.js), checked after the fields and
    raised directly as :class:`apiary.errors.ValidationError`: prerequisite names unique per
    type, deployment names unique, references from task roles/defaults/extras resolve.
    """

    protocol_version: ProtocolVersion = Field(alias="protocolVersion")
    name: Name
    type: Literal["job"]
    version: Version | None = None
    contributor: str | None = None
    description: str | None = None
    job_retry_count: RetryCount = Field(0, alias="jobRetryCount")
    prerequisites: Annotated[list[Prerequisite], Field(min_length=1)] | None = None
    parameters: dict[str, Any] | None = None
    secrets: dict[str, Any] | None = None
    task_roles: Annotated[dict[TaskRoleName, TaskRole], Field(min_length=1)] = Field(alias="taskRoles")
    deployments: Annotated[list[Deployment], Field(min_length=1)] | None = None
    defaults: Defaults | None = None
    extras: Extras | None = None

    # ------------------------------------------------------------------ cross-field checks

    @model_validator(mode="after")
    def _check_references(self) -> JobSpec:
        # Raised as apiary's ValidationError (not a ValueError) so pydantic lets it through
        # with its exact field path instead of re-wrapping it at the model root.
        by_type: dict[str, dict[str, Any]] = {t: {} for t in _PREREQUISITE_TYPES}
        for i, item in enumerate(self.prerequisites or []):
            if item.name in by_type[item.type]:
                raise ValidationError(
                    f"prerequisites[{i}].name", f"duplicated {item.type} prerequisite name {item.name!r}"
                )
            by_type[item.type][item.name] = item
        all_names = {name for names in by_type.values() for name in names}

        for tr_name, tr in self.task_roles.items():
            base = f"taskRoles.{tr_name}"
            if tr.docker_image not in by_type["dockerimage"]:
                raise ValidationError(
                    f"{base}.dockerImage",
                    f"names {tr.docker_image!r}, which is no dockerimage prerequisite "
                    f"(defined: {sorted(by_type['dockerimage']) or 'none'})",
                )
            for kind in ("data", "output", "script"):
                ref = getattr(tr, kind)
                if ref is not None and ref not in by_type[kind]:
                    raise ValidationError(f"{base}.{kind}", f"names {ref!r}, which is no {kind} prerequisite")
            for i, ref in enumerate(tr.prerequisites or []):
                if ref not in all_names:
                    raise ValidationError(
                        f"{base}.prerequisites[{i}]", f"names {ref!r}, which is no prerequisite"
                    )

        deployment_names: set[str] = set()
        for i, dep in enumerate(self.deployments or []):
            if dep.name in deployment_names:
                raise ValidationError(f"deployments[{i}].name", f"duplicated deployment name {dep.name!r}")
            deployment_names.add(dep.name)
            for tr_name in dep.task_roles:
                if tr_name not in self.task_roles:
                    raise ValidationError(
                        f"deployments[{i}].taskRoles.{tr_name}",
                        f"names task role {tr_name!r}, which the job does not have",
                    )
        if self.defaults and self.defaults.deployment is not None:
            if self.defaults.deployment not in deployment_names:
                raise ValidationError(
                    "defaults.deployment",
                    f"names deployment {self.defaults.deployment!r}, which is not defined",
                )

        hived = self.extras.hived_scheduler if self.extras else None
        for tr_name in (hived.task_roles or {}) if hived else {}:
            if tr_name not in self.task_roles:
                raise ValidationError(
                    f"extras.hivedScheduler.taskRoles.{tr_name}",
                    f"names task role {tr_name!r}, which the job does not have "
                    f"(task roles: {sorted(self.task_roles)})",
                )
        # Liveness / readiness probes under extras.apiary.taskRoles.<tr> (apiary.spec.probes).
        validate_probes(self.extras, self.task_roles)
        return self

    # ------------------------------------------------------------------ derived views

    @property
    def virtual_cluster(self) -> str:
        """``defaults.virtualCluster``, or ``"default"`` (OpenPAI's default VC) when unset."""
        if self.defaults and self.defaults.virtual_cluster:
            return self.defaults.virtual_cluster
        return DEFAULT_VIRTUAL_CLUSTER

    @property
    def priority_class(self) -> str:
        """``extras.hivedScheduler.jobPriorityClass``, or ``"test"`` (rest-server default)."""
        hived = self.extras.hived_scheduler if self.extras else None
        return hived.job_priority_class if hived else DEFAULT_PRIORITY_CLASS

    @property
    def priority(self) -> int:
        """HiveD priority of :attr:`priority_class` per :data:`PRIORITY_CLASSES` (-1 = opportunistic)."""
        return PRIORITY_CLASSES[self.priority_class]

    def port_names(self, task_role: str) -> list[str]:
        """The named ports each instance of ``task_role`` gets (its ``resourcePerInstance.ports``
        labels, ``ssh`` when the ssh runtime plugin applies to it, and ``tensorboard`` for the role the
        tensorboard runtime plugin runs on, sorted; :func:`apiary.spec.ports.task_ports` chooses the numbers)."""
        names = set(self.task_roles[task_role].resource_per_instance.ports or {})
        if self.ssh_plugin(task_role) is not None:
            names.add(SSH_PORT_NAME)
        tensorboard = self.tensorboard_plugin()
        if tensorboard is not None and tensorboard.role == task_role:
            names.add(TENSORBOARD_PORT_NAME)
        return sorted(names)

    def tensorboard_plugin(self) -> TensorBoardPlugin | None:
        """The tensorboard runtime plugin (:func:`apiary.spec.tensorboard.tensorboard_plugin`), or None.
        Raises ValidationError for a malformed entry (checked at submission)."""
        return tensorboard_plugin(self.extras.model_extra if self.extras else None, list(self.task_roles))

    def ssh_plugin(self, task_role: str) -> SshPlugin | None:
        """The ssh runtime plugin of ``task_role`` (:func:`apiary.spec.ssh.ssh_plugins`), or None."""
        return self.ssh_plugins().get(task_role)

    def ssh_plugins(self) -> dict[str, SshPlugin]:
        """``{task role: SshPlugin}`` for the roles the ssh runtime plugin applies to. Raises
        ValidationError for a malformed entry (checked at submission)."""
        return ssh_plugins(self.extras.model_extra if self.extras else None, self.task_roles, gang=self.gang)

    def storage_requests(self) -> tuple[StorageRequest, ...] | None:
        """The storage configs the job names (:func:`apiary.spec.storage.storage_requests`): None
        when it names none (its user's defaults apply). Raises ValidationError for a malformed one."""
        return storage_requests(self.extras.model_extra if self.extras else None)

    @property
    def gang(self) -> bool:
        """``extras.gangAllocation``; True (gang scheduling) when unset."""
        return self.extras.gang_allocation if self.extras else True

    def _hived_task_role(self, task_role: str) -> HivedTaskRole | None:
        hived = self.extras.hived_scheduler if self.extras else None
        return (hived.task_roles or {}).get(task_role) if hived else None

    def sku_type(self, task_role: str) -> str | None:
        """``extras.hivedScheduler.taskRoles.<task_role>.skuType``, or None when not set."""
        hived_tr = self._hived_task_role(task_role)
        return hived_tr.sku_type if hived_tr else None

    def pinned_cell_id(self, task_role: str) -> str | None:
        """``extras.hivedScheduler.taskRoles.<task_role>.pinnedCellId``, or None when not set."""
        hived_tr = self._hived_task_role(task_role)
        return hived_tr.pinned_cell_id if hived_tr else None

    def active_deployment(self) -> Deployment | None:
        """The deployment in force: ``defaults.deployment``, else the only one; None otherwise.

        OpenPAI activates only the deployment chosen in ``defaults`` (schema ``deployments``);
        Apiary also takes a lone deployment as chosen, since there is nothing to choose from.
        """
        deployments = self.deployments or []
        if self.defaults and self.defaults.deployment is not None:
            return next(d for d in deployments if d.name == self.defaults.deployment)
        return deployments[0] if len(deployments) == 1 else None

    def template_context(self, task_role: str) -> dict[str, Any]:
        """What ``<% $x %>`` can reference in ``task_role``: ``parameters``, ``secrets`` (whole
        job) and ``script``/``data``/``output`` (the prerequisite the task role selects, as its
        wire-form dict, so ``$data.uri[0]`` and ``$script.name`` work)."""
        tr = self.task_roles[task_role]
        by_key = {(p.type, p.name): p for p in self.prerequisites or []}
        context: dict[str, Any] = {"parameters": self.parameters or {}, "secrets": self.secrets or {}}
        for kind in ("script", "data", "output"):
            ref = getattr(tr, kind)
            if ref is not None:
                context[kind] = by_key[(kind, ref)].model_dump(by_alias=True, exclude_none=True)
        return context

    def render_commands(self, task_role: str) -> list[str]:
        """The shell lines one instance of ``task_role`` runs, templates resolved.

        Order: the active deployment's ``preCommands`` for the role, the role's ``commands``,
        then its ``postCommands`` (schema ``deployments``). Each line has its ``<% $... %>``
        tags replaced (see :mod:`apiary.spec.templating`).

        Raises :class:`apiary.errors.ValidationError`: ``taskRoles.<task_role>`` for an unknown
        task role; the path of the offending line (``taskRoles.train.commands[0]``,
        ``deployments[0].taskRoles.train.preCommands[1]``) for an unknown reference.
        """
        lines = self._command_lines(task_role)  # first: it names an unknown task role
        context = self.template_context(task_role)
        return [render(text, context, field) for field, text in lines]

    def rendered_commands_size(self, task_role: str) -> int:
        """UTF-8 bytes of :meth:`render_commands` (each line plus one newline), counted without
        rendering: a reference used many times is rendered once (see
        :func:`apiary.spec.templating.rendered_size`; an unknown reference counts 0 bytes here and
        fails in :meth:`render_commands`). Raises :class:`ValidationError` for an unknown task role.
        """
        lines = self._command_lines(task_role)
        context = self.template_context(task_role)
        return sum(rendered_size(text, context, field) + 1 for field, text in lines)

    def _command_lines(self, task_role: str) -> list[tuple[str, str]]:
        """``(field path, template)`` of every line :meth:`render_commands` renders, in order."""
        if task_role not in self.task_roles:
            raise ValidationError(f"taskRoles.{task_role}", f"the job has no task role {task_role!r}")
        lines: list[tuple[str, str]] = []
        deployment = self.active_deployment()
        dep_tr = deployment.task_roles.get(task_role) if deployment else None
        if deployment is not None and dep_tr:
            dep_base = f"deployments[{(self.deployments or []).index(deployment)}].taskRoles.{task_role}"
            lines += [(f"{dep_base}.preCommands[{i}]", c) for i, c in enumerate(dep_tr.pre_commands or [])]
        lines += [
            (f"taskRoles.{task_role}.commands[{i}]", c)
            for i, c in enumerate(self.task_roles[task_role].commands)
        ]
        if dep_tr:
            lines += [(f"{dep_base}.postCommands[{i}]", c) for i, c in enumerate(dep_tr.post_commands or [])]
        return lines

    # ------------------------------------------------------------------ serialisation

    def to_wire(self) -> dict[str, Any]:
        """The protocol as plain data with wire (camelCase) keys, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True)

    def to_yaml(self, *, redact_secrets: bool = False) -> str:
        """The job as protocol YAML that :func:`parse_job` reads back into an equal model.

        Secrets are written as they are unless ``redact_secrets`` (then each value is
        ``"******"``; OpenPAI hides secrets from job cloning and logs the same way).
        """
        data = self.to_wire()
        if redact_secrets and "secrets" in data:
            data["secrets"] = dict.fromkeys(data["secrets"], "******")
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False)


# --------------------------------------------------------------------------- parsing

_FRIENDLY = {
    "extra_forbidden": "unknown field: the OpenPAI job protocol v2 does not define it here",
    "missing": "required field is missing",
}


def _field_path(loc: tuple[int | str, ...]) -> str:
    """Dotted wire path from a pydantic ``loc``: ``taskRoles.train.commands[0]``."""
    parts: list[str] = []
    previous: int | str | None = None
    for item in loc:
        if item == "[key]":
            continue  # a dict key failed: the key itself (already in loc) is the field
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(previous, int) and item in _PREREQUISITE_TYPES and loc[0] == "prerequisites":
            pass  # the discriminated-union tag pydantic inserts after a list index
        else:
            step = admission.path_key(item)
            parts.append(f".{step}" if parts else step)
        previous = item
    return "".join(parts)


def _brief(value: Any) -> str:
    """``repr(value)`` cut to 40 characters for a message. An int past Python's 4,300-digit
    str limit (YAML ``0b1...`` builds one) has no repr: it is described by its size instead."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 40 else f"{text[:37]}..."


def _pydantic_to_validation_error(exc: pydantic.ValidationError) -> ValidationError:
    found: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] in ("union_tag_not_found", "union_tag_invalid"):
            loc = (*loc, "type")
        reason = _FRIENDLY.get(err["type"], err["msg"])
        if loc and loc[-1] == "protocolVersion" and err["type"] == "literal_error":
            reason = f'protocol version must be 2 (or "2"), got {_brief(err["input"])}'
        if err["type"] == "less_than_equal":  # every maximum in this module is one of Apiary's
            reason = (
                f"{_brief(err['input'])} is more than {err.get('ctx', {}).get('le')}, Apiary's maximum "
                "(the OpenPAI protocol sets none)"
            )
        if err["type"] == "union_tag_invalid":
            reason = f"prerequisite type must be one of {', '.join(_PREREQUISITE_TYPES)}"
        if err["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
            reason += did_you_mean(loc[-1], field_names_at(JobSpec, loc[:-1]))
        found.append((_field_path(loc), reason))
    field, reason = found[0]
    rest = "; ".join(f"{f}: {r}" if f else r for f, r in found[1:])
    return ValidationError(field, f"{reason}; {rest}" if rest else reason)


def parse_job(
    text: str | bytes, *, max_instances: int = DEFAULT_MAX_JOB_INSTANCES, stored: bool = False
) -> JobSpec:
    """Parse an OpenPAI job protocol v2 document (YAML, or JSON read as JSON) into a :class:`JobSpec`.

    ``max_instances``: most instances the job may have, all task roles together (the control
    plane's configured limit; default :data:`DEFAULT_MAX_JOB_INSTANCES`).

    ``stored``: the text is a job the platform accepted earlier, reloaded from its store. Then the
    rules of :mod:`apiary.spec.admission` (no NUL or lone surrogate, only implemented runtime
    plugins, rendered commands within :data:`apiary.spec.admission.MAX_RENDERED_BYTES`) are not
    applied, and a task role name and ``protocolVersion`` are held to the rule they were accepted
    under (a trailing newline; the number 2.0), so that no upgrade makes a stored job unreadable.

    Raises :class:`apiary.errors.ValidationError` and nothing else for bad input:

    * ``field="body"`` for undecodable bytes, broken YAML (reason gives line and column,
      1-based), YAML outside :func:`apiary.spec.safeyaml.load`'s limits (nesting, aliases,
      size, duplicate keys) or a document that is not a mapping;
    * ``field="taskRoles"`` for more than ``max_instances`` instances in all;
    * the rules of :mod:`apiary.spec.admission`, each naming its field
      (``taskRoles.train.commands[0]`` for a NUL, ``extras.com.microsoft.pai.runtimeplugin[0].plugin``,
      ``taskRoles.train.commands`` for commands that render past the limit);
    * otherwise ``field`` is the dotted wire path of the first offending field
      (``taskRoles.train.resourcePerInstance.gpu``), and the message lists every problem
      found, ``"a.b: reason; c: reason"``.
    """
    data = safeyaml.load(text, field="body", what="job spec")
    if not isinstance(data, dict):
        raise ValidationError("body", f"job spec must be a YAML mapping, got {type(data).__name__}")
    if not stored:
        admission.refuse_bad_text(data)
    try:
        spec = JobSpec.model_validate(data, context={"stored": stored})
    except pydantic.ValidationError as exc:
        error = _pydantic_to_validation_error(exc)
        logger.debug("rejected job spec: %s", error.message)
        raise error from None
    total = sum(role.instances for role in spec.task_roles.values())
    if total > max_instances:
        raise ValidationError(
            "taskRoles",
            f"the job asks for {total} instances in all task roles, more than the {max_instances} "
            "one job may have (a limit the platform configures: APIARY_MAX_INSTANCES)",
        )
    if not stored:
        admission.check_runtime_plugins(spec.extras.model_extra if spec.extras else None)
        spec.storage_requests()  # a malformed storage request is a 400 naming its field
        spec.ssh_plugins()  # so is a malformed ssh plugin entry
        spec.tensorboard_plugin()  # and a malformed tensorboard plugin entry
        admission.check_rendered_sizes(spec)
    return spec
