"""ssh keys: users' SSH public keys and the key pairs of jobs with the ssh runtime plugin

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 10:00:00

OpenPAI's ssh runtime plugin: ``user_ssh_keys`` (a user's public keys, title -> value; a user's rows
go with the user) and ``job_ssh_keys`` (per job: the instances' shared client key pair and the host
key pair their sshds present; a job's row goes with the job). New tables only: nothing to carry over.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'user_ssh_keys',
        sa.Column('user', sa.String(length=100), nullable=False),
        sa.Column('title', sa.String(length=100), nullable=False),
        sa.Column('value', sa.Text(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['user'], ['users.name'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('user', 'title'),
    )
    op.create_table(
        'job_ssh_keys',
        sa.Column('job_id', sa.String(length=300), nullable=False),
        sa.Column('private_key', sa.Text(), nullable=False),
        sa.Column('public_key', sa.Text(), nullable=False),
        sa.Column('host_private_key', sa.Text(), nullable=False),
        sa.Column('host_public_key', sa.Text(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id'),
    )


def downgrade() -> None:
    op.drop_table('job_ssh_keys')
    op.drop_table('user_ssh_keys')
