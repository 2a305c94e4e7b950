"""What the routers get from the app (FastAPI dependencies): the plane, the alert receiver, the waiters,
the drill results.

``create_app`` puts them on ``app.state``; the dependencies are ``async`` so FastAPI calls them in
the event loop instead of a worker thread.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from apiary.api.longpoll import NodeWaiters
from apiary.control import ControlPlane
from apiary.drills.board import DrillBoard
from apiary.ops.alerts import AlertReceiver


async def get_plane(request: Request) -> ControlPlane:
    return request.app.state.plane


async def get_receiver(request: Request) -> AlertReceiver:
    return request.app.state.receiver


async def get_board(request: Request) -> DrillBoard:
    return request.app.state.drills


async def get_waiters(request: Request) -> NodeWaiters:
    return request.app.state.waiters


Plane = Annotated[ControlPlane, Depends(get_plane)]
Receiver = Annotated[AlertReceiver, Depends(get_receiver)]
Waiters = Annotated[NodeWaiters, Depends(get_waiters)]
Board = Annotated[DrillBoard, Depends(get_board)]
