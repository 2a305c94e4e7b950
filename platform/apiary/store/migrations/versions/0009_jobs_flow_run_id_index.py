"""jobs.flow_run_id indexed: a submission or link naming a flow run looks up the jobs attached to it

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 02:30:00

A Prefect flow run follows one job (and its Retry copies): every submission, clone and
``PUT /api/v2/flowRuns`` that names a flow run reads the jobs already attached to it
(apiary.control.intake.flow_run_holders). Without the index that read scans the jobs table.
"""

from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f('ix_jobs_flow_run_id'), 'jobs', ['flow_run_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_jobs_flow_run_id'), table_name='jobs')
