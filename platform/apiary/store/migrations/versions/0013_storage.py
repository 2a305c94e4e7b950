"""storage: storage servers, storage configs and group -> storage config grants

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 09:20:00

OpenPAI's team-wise storage: ``storage_servers`` (name, type, connection data),
``storage_configs`` (name, default flag, mount infos) and ``group_storage_grants`` (which groups
may use which config; a group's row goes with the group). New tables only: nothing to carry over.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'storage_servers',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('type', sa.String(length=20), nullable=False),
        sa.Column('data', sa.JSON(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_table(
        'storage_configs',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('default', sa.Boolean(), nullable=False),
        sa.Column('mount_infos', sa.JSON(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_table(
        'group_storage_grants',
        sa.Column('group', sa.String(length=100), nullable=False),
        sa.Column('config', sa.String(length=100), nullable=False),
        sa.ForeignKeyConstraint(['group'], ['groups.name'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('group', 'config'),
    )


def downgrade() -> None:
    op.drop_table('group_storage_grants')
    op.drop_table('storage_configs')
    op.drop_table('storage_servers')
