"""Node routes for people and tools: the node list and cordoning."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from apiary.api.auth import Admin, Caller
from apiary.api.deps import Plane
from apiary.api.guards import plain_text
from apiary.api.schemas import ERROR_RESPONSES, CordonRequest, NodeJson

router = APIRouter(prefix="/api/v2", tags=["nodes"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(plain_text)])


@router.get("/nodes", response_model=list[NodeJson])
def nodes(plane: Plane, _caller: Caller) -> list[dict]:
    """Every node of the cluster config, with its agent's last report and the GPUs in use."""
    return plane.list_nodes()


@router.put("/nodes/{node}/cordon", response_model=NodeJson)
def cordon(node: str, body: CordonRequest, plane: Plane, _caller: Admin) -> dict:
    """``{"value": true}`` cordons the node (no new placements), ``false`` uncordons it. Admins only."""
    return plane.cordon(node, body.value)
