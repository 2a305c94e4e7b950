"""bootstrap_tokens and leases: nodes that join with a short-lived token; a leader-election lease

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 08:40:00

``bootstrap_tokens`` (apiary.store.models.BootstrapToken): the tokens ``apiary agent join``
spends, a digest each. ``leases`` (apiary.store.models.Lease): the control plane's leader lease
and its fencing epoch. Both tables are new; the downgrade drops them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'bootstrap_tokens',
        sa.Column('id', sa.String(length=16), nullable=False),
        sa.Column('digest', sa.String(length=64), nullable=False),
        sa.Column('node', sa.String(length=200), nullable=True),
        sa.Column('description', sa.Text(), nullable=False),
        sa.Column('created_by', sa.String(length=200), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.Column('expires', sa.Float(), nullable=False),
        sa.Column('used', sa.Float(), nullable=True),
        sa.Column('used_by', sa.String(length=200), nullable=True),
        sa.Column('revoked', sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_table(
        'leases',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('holder', sa.String(length=200), nullable=False),
        sa.Column('holder_url', sa.String(length=500), nullable=False),
        sa.Column('epoch', sa.Integer(), nullable=False),
        sa.Column('acquired', sa.Float(), nullable=False),
        sa.Column('renewed', sa.Float(), nullable=False),
        sa.Column('duration_s', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )


def downgrade() -> None:
    op.drop_table('leases')
    op.drop_table('bootstrap_tokens')
