#!/usr/bin/env python
"""Django's command-line utility for the example shop (run from anywhere)."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # The repository root instead of this directory, whose celery.py would shadow Celery, so
    # ``example_project.django_shop`` imports from a checkout.
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.django_shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
