"""ASGI entry point: `make up` serves it with uvicorn workers under gunicorn (event streams are async views)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
# Each request runs in a thread of its own here: its database connection goes back to a pool at its end
# (genserver/settings.py, DATABASE_POOL) instead of staying open with the thread.
os.environ.setdefault("GENSERVER_DATABASE_POOL", "16")
application = get_asgi_application()
