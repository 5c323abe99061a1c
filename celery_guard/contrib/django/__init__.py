"""celery_guard for Django projects: add ``"celery_guard.contrib.django"`` to
``INSTALLED_APPS``, run ``python manage.py migrate``, and install the guard on the project's
Celery app with :func:`install` (docs/django.md).

The store then lives on Django's database (the ``default`` alias, or
``CELERY_GUARD_DATABASE``), and ``with self.guard.atomic():`` in a task body commits the ORM's
writes together with the key's COMPLETED marker, or not at all.
"""

from .database import DjangoTransactionMisuse
from .integration import GuardedDjangoTask, install

__all__ = ["DjangoTransactionMisuse", "GuardedDjangoTask", "install"]
