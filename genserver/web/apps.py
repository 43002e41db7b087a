"""The web page's Django app configuration."""

from django.apps import AppConfig


class WebConfig(AppConfig):
    name = "genserver.web"
    label = "web"
    verbose_name = "Web page"
