"""ci_runs and deployments: CI pipeline runs and production deployments, as the flows report them

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26 10:00:00

One row per pipeline run (upserted on its Prefect flow run id) and one per deployment; the
``apiary_ci_*`` and ``apiary_deploy_*`` metrics are computed from them (apiary.ci.records).
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'ci_runs',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('flow_run_id', sa.String(length=64), nullable=False),
        sa.Column('repo', sa.String(length=200), nullable=False),
        sa.Column('pr_number', sa.Integer(), nullable=True),
        sa.Column('sha', sa.String(length=64), nullable=False),
        sa.Column('ref', sa.String(length=300), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('result', sa.String(length=16), nullable=False),
        sa.Column('failed_stage', sa.String(length=100), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('started_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.Float(), nullable=True),
        sa.Column('duration_s', sa.Float(), nullable=True),
        sa.Column('stages', sa.JSON(), nullable=False),
        sa.Column('target_url', sa.String(length=2048), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('flow_run_id'),
    )
    op.create_index('ix_ci_runs_started_at', 'ci_runs', ['started_at'], unique=False)
    op.create_table(
        'deployments',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('sha', sa.String(length=64), nullable=False),
        sa.Column('images', sa.JSON(), nullable=False),
        sa.Column('previous_images', sa.JSON(), nullable=True),
        sa.Column('actor', sa.String(length=200), nullable=False),
        sa.Column('trigger', sa.String(length=16), nullable=False),
        sa.Column('started_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.Float(), nullable=False),
        sa.Column('duration_s', sa.Float(), nullable=False),
        sa.Column('result', sa.String(length=16), nullable=False),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('steps', sa.JSON(), nullable=False),
        sa.Column('flow_run_id', sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('flow_run_id'),
    )
    op.create_index('ix_deployments_sha', 'deployments', ['sha'], unique=False)
    op.create_index('ix_deployments_started_at', 'deployments', ['started_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_deployments_started_at', table_name='deployments')
    op.drop_index('ix_deployments_sha', table_name='deployments')
    op.drop_table('deployments')
    op.drop_index('ix_ci_runs_started_at', table_name='ci_runs')
    op.drop_table('ci_runs')
