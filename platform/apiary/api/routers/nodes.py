"""Node routes for people and tools: the node list, one node, and cordoning."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from apiary.api.auth import Admin, Caller
from apiary.api.deps import Plane
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, CordonRequest, NodeJson
from apiary.errors import NotFoundError

router = APIRouter(prefix="/api/v2", tags=["nodes"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])


@router.get("/nodes", response_model=list[NodeJson])
def nodes(plane: Plane, _caller: Caller) -> list[dict]:
    """Every node of the cluster config, with its agent's last report and the GPUs in use."""
    return plane.list_nodes()


@router.get("/nodes/{node}", response_model=NodeJson)
def node(node: str, plane: Plane, _caller: Caller) -> dict:
    """One node, as in the list, with its cordons (who set each, when and why). 404 for a node the
    cluster config does not declare."""
    found = next((n for n in plane.list_nodes() if n["name"] == node), None)
    if found is None:
        raise NotFoundError(f"Node {node} is not in the cluster config.")
    return found


@router.put("/nodes/{node}/cordon", response_model=NodeJson)
def cordon(node: str, body: CordonRequest, plane: Plane, caller: Admin) -> dict:
    """``{"value": true, "reason": "..."}`` sets the ``source``'s cordon (default ``admin``; no new
    placements while the node holds any cordon), ``false`` removes that source's cordon only, and
    ``{"value": false, "all": true}`` removes every cordon. Admins only; the caller is recorded as
    the cordon's ``by``. 400 naming ``source``, ``reason`` or ``all`` for a bad one."""
    return plane.cordon(node, body.value, source=body.source, reason=body.reason or "", by=caller.name,
                        every_source=body.all)
