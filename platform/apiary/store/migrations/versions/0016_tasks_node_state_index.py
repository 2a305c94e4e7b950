"""tasks indexed by (node, state) instead of node alone: a node's live tasks without its history

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30 09:45:00

An agent's assignment poll, a lost node and a drain read the node's STARTING and RUNNING tasks
(apiary.control.assignments, apiary.control.node_service). With an index on ``node`` alone,
PostgreSQL's plan for a table not yet analysed reads every task the node ever ran and filters
them by state, so each poll grew with the node's history (measured in a 20 jobs/s run: 301 task
rows fetched a job). The composite index answers with the live tasks only, and its ``node``
prefix still serves the queries by node alone.
"""

from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_tasks_node_state', 'tasks', ['node', 'state'], unique=False)
    op.drop_index(op.f('ix_tasks_node'), table_name='tasks')


def downgrade() -> None:
    op.create_index(op.f('ix_tasks_node'), 'tasks', ['node'], unique=False)
    op.drop_index('ix_tasks_node_state', table_name='tasks')
