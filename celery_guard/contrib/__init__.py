"""Integrations with frameworks: the top layer of the package, which nothing else imports.

Each lives in its own subpackage and may import anything below it; the core never imports a
framework (the import-linter contracts in pyproject.toml).
"""
