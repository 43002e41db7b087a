#!/usr/bin/env python
"""Django's command-line utility for genserver."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
    from django.core.management import execute_from_command_line

    from genserver.config import exit_on_settings_error

    with exit_on_settings_error():  # a bad GENSERVER_* value: one line naming it, exit 2
        execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
