"""ci_deliveries: GitHub webhook deliveries the CI intake accepted

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 21:00:00

One row per delivery, keyed by GitHub's delivery id (deduplication survives restarts), with what
it asked for and how far its pipeline got (apiary.ci).
"""

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'ci_deliveries',
        sa.Column('delivery', sa.String(length=64), nullable=False),
        sa.Column('event', sa.String(length=64), nullable=False),
        sa.Column('action', sa.String(length=64), nullable=True),
        sa.Column('repo', sa.String(length=200), nullable=True),
        sa.Column('pr_number', sa.Integer(), nullable=True),
        sa.Column('sha', sa.String(length=64), nullable=True),
        sa.Column('ref', sa.String(length=300), nullable=True),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('flow_run_id', sa.String(length=64), nullable=True),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('received_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('delivery'),
    )
    op.create_index('ix_ci_deliveries_received_at', 'ci_deliveries', ['received_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_ci_deliveries_received_at', table_name='ci_deliveries')
    op.drop_table('ci_deliveries')
