"""ASGI entry point: `make up` serves it with uvicorn workers under gunicorn (genserver/serving.py: which request
runs on Django's ASGI handler, which on kept WSGI threads)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
# On PostgreSQL every request borrows its connection from a pool and hands it back at its end (genserver/settings.py,
# DATABASE_POOL), so the server's connections stay bounded whatever the threads do.
os.environ.setdefault("GENSERVER_DATABASE_POOL", "16")

from genserver import serving  # after the environment above: Django reads it as the handlers are built

application = serving.application()
