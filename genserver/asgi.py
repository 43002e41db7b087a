"""ASGI entry point: `make up` serves it with uvicorn workers under gunicorn (event streams are async views)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
application = get_asgi_application()
