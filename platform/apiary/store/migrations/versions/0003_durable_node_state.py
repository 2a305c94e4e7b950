"""durable node state: metrics URL and queued faults; jobs' arrival order

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 16:00:00

Node facts that lived only in the control plane's memory (metrics URL, queued simulated-GPU faults
numbered by an in-memory counter that restarted at 1) move to the store, so a restart neither loses
queued faults nor reuses fault ids the agents have already seen. Jobs get ``submit_seq``, their arrival
order, the FIFO tie-break at equal submission times (existing jobs are numbered by submission time,
then id).
"""

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'node_faults',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('node', sa.String(length=200), nullable=False),
        sa.Column('gpu', sa.Integer(), nullable=False),
        sa.Column('fault', sa.JSON(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table('node_faults', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_node_faults_node'), ['node'], unique=False)
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('metrics_url', sa.String(length=400), nullable=True))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('submit_seq', sa.Integer(), nullable=True))
    op.execute(
        "UPDATE jobs SET submit_seq = 1 + (SELECT COUNT(*) FROM jobs AS j2 WHERE j2.submission_time < "
        "jobs.submission_time OR (j2.submission_time = jobs.submission_time AND j2.id < jobs.id))"
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.alter_column('submit_seq', existing_type=sa.Integer(), nullable=False)
        batch_op.create_index(batch_op.f('ix_jobs_submit_seq'), ['submit_seq'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_submit_seq'))
        batch_op.drop_column('submit_seq')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('metrics_url')
    with op.batch_alter_table('node_faults', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_node_faults_node'))
    op.drop_table('node_faults')
