"""Durable state (SQLAlchemy; SQLite by default, PostgreSQL by URL; Alembic migrations)."""

from apiary.store.engine import make_engine, migrate, session_factory
from apiary.store.models import Alert, AlertAction, Attempt, Base, Event, Job, Node, NodeFault, Placement, Task

__all__ = [
    "Alert", "AlertAction", "Attempt", "Base", "Event", "Job", "Node", "NodeFault", "Placement", "Task",
    "make_engine", "migrate", "session_factory",
]
