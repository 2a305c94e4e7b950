"""node_cordons: a node holds a set of cordons, each with its source, reason, actor and time

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28 05:40:00

``nodes.cordoned`` (one boolean, four setters, no reason) becomes the ``node_cordons`` table
(apiary.store.models.NodeCordon), keyed by (node, source); a node is cordoned while it has a row.
The upgrade turns each cordoned node into one ``admin`` cordon with the reason
:data:`MIGRATED_REASON` and drops the column; the downgrade sets ``cordoned`` on every node that
has any cordon and drops the table (the sources and reasons are lost).
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

#: The reason given to the cordons the upgrade carries over from ``nodes.cordoned``.
MIGRATED_REASON = "cordoned before cordons had reasons"

_NODES = sa.table('nodes', sa.column('name', sa.String()), sa.column('cordoned', sa.Boolean()))
_CORDONS = sa.table('node_cordons', sa.column('node', sa.String()), sa.column('source', sa.String()),
                    sa.column('reason', sa.Text()), sa.column('by', sa.String()), sa.column('at', sa.Float()))


def upgrade() -> None:
    # Read the booleans and drop the column before node_cordons exists: SQLite's batch mode copies
    # ``nodes`` and drops the old table, which would cascade to cordons that referenced it.
    conn = op.get_bind()
    cordoned = [name for (name,) in conn.execute(sa.select(_NODES.c.name).where(_NODES.c.cordoned.is_(True)))]
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('cordoned')
    op.create_table(
        'node_cordons',
        sa.Column('node', sa.String(length=200), nullable=False),
        sa.Column('source', sa.String(length=120), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('by', sa.String(length=200), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['node'], ['nodes.name'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('node', 'source'),
    )
    if cordoned:
        now = time.time()
        conn.execute(_CORDONS.insert(), [
            {"node": name, "source": "admin", "reason": MIGRATED_REASON, "by": "", "at": now} for name in cordoned])


def downgrade() -> None:
    conn = op.get_bind()
    held = [name for (name,) in conn.execute(sa.select(_CORDONS.c.node).distinct())]
    op.drop_table('node_cordons')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cordoned', sa.Boolean(), nullable=False, server_default=sa.false()))
    if held:
        conn.execute(_NODES.update().where(_NODES.c.name.in_(held)).values(cordoned=True))
