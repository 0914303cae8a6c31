"""CLI commands, one module each (see ``gradzip.cli``)."""
