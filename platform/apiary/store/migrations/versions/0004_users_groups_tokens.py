"""users, groups, virtual-cluster grants and bearer tokens

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 16:30:00

Tenancy (OpenPAI's users, groups and group -> virtual cluster grants) and the credentials every
API call carries: personal tokens for users, one token per node agent, service tokens for the
Prefect bridge and Alertmanager. Tokens are stored as SHA-256 digests only.
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'users',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('email', sa.String(length=200), nullable=True),
        sa.Column('created', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_table(
        'groups',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('admin', sa.Boolean(), nullable=False),
        sa.Column('description', sa.Text(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_table(
        'group_members',
        sa.Column('group', sa.String(length=100), nullable=False),
        sa.Column('user', sa.String(length=100), nullable=False),
        sa.ForeignKeyConstraint(['group'], ['groups.name'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['user'], ['users.name'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('group', 'user'),
    )
    op.create_index('ix_group_members_user', 'group_members', ['user'], unique=False)
    op.create_table(
        'group_grants',
        sa.Column('group', sa.String(length=100), nullable=False),
        sa.Column('virtual_cluster', sa.String(length=100), nullable=False),
        sa.ForeignKeyConstraint(['group'], ['groups.name'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('group', 'virtual_cluster'),
    )
    op.create_table(
        'tokens',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('digest', sa.String(length=64), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('subject', sa.String(length=200), nullable=False),
        sa.Column('description', sa.Text(), nullable=False),
        sa.Column('created', sa.Float(), nullable=False),
        sa.Column('expires', sa.Float(), nullable=True),
        sa.Column('revoked', sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_tokens_subject', 'tokens', ['subject'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_tokens_subject', table_name='tokens')
    op.drop_table('tokens')
    op.drop_table('group_grants')
    op.drop_index('ix_group_members_user', table_name='group_members')
    op.drop_table('group_members')
    op.drop_table('groups')
    op.drop_table('users')
