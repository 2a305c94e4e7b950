"""Identity: users, groups, virtual-cluster grants, bearer tokens and the principals they stand for.

:class:`Directory` keeps them in the store; :class:`Principal` says what a caller may do (the
trust model is in :mod:`apiary.auth.principal`); :func:`bootstrap` is what ``apiary up`` creates.
"""

from apiary.auth.bootstrap import bootstrap
from apiary.auth.directory import Directory, NewToken
from apiary.auth.principal import ALERTMANAGER, BRIDGE, Principal

__all__ = ["ALERTMANAGER", "BRIDGE", "Directory", "NewToken", "Principal", "bootstrap"]
