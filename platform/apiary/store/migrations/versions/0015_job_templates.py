"""job templates: the marketplace's templates (OpenPAI job YAML with parameters and a description)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02 10:00:00

``job_templates``: one row per template, keyed by name; ``owner`` is the user who published it
(not a foreign key: a template outlives its publisher's account, and admins curate it).
A new table only: nothing to carry over.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'job_templates',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('owner', sa.String(length=100), nullable=False),
        sa.Column('summary', sa.Text(), nullable=False),
        sa.Column('description', sa.Text(), nullable=False),
        sa.Column('author', sa.String(length=200), nullable=False),
        sa.Column('tags', sa.JSON(), nullable=False),
        sa.Column('visibility', sa.JSON(), nullable=False),
        sa.Column('parameter_schema', sa.JSON(), nullable=False),
        sa.Column('job_yaml', sa.Text(), nullable=False),
        sa.Column('official', sa.Boolean(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.Column('updated', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_index('ix_job_templates_owner', 'job_templates', ['owner'])


def downgrade() -> None:
    op.drop_index('ix_job_templates_owner', table_name='job_templates')
    op.drop_table('job_templates')
