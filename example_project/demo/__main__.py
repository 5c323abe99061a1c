"""``python -m example_project.demo``: see the package's docstring, or ``--help``."""

import sys

from example_project.demo import main

sys.exit(main())
