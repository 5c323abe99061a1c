"""Which fork of the process this is, known without a system call.

Objects that must not be shared across a fork (a connection, a thread, a lock a parent's thread
may have held) note :data:`current` when they are made and compare it on use
(``forks.current``, read from the module each time). The count goes up in every child that
``os.fork()`` makes (``os.register_at_fork``, which billiard's prefork pool and
multiprocessing's fork start method go through), so a child never sees its parent's value. A
check is one attribute read, where ``os.getpid()`` is a system call on every use (glibc stopped
caching it in 2.25): a delivery made a dozen of them.
"""

from __future__ import annotations

import os

#: This process's fork generation: 0 in the first process, its parent's + 1 in a child.
current = 0


def _after_fork_in_child() -> None:
    global current
    current += 1


os.register_at_fork(after_in_child=_after_fork_in_child)
