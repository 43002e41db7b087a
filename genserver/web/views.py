"""The page's views: one shell page (the browser script talks to the API) and Django's session login.

The page holds no business rule: limits, defaults, queue state and refusals all
come from the API (GET /api/v1/models/, /jobs/, /queues/) at run time.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.http.request import split_domain_port
from django.shortcuts import render
from django.views.decorators.csrf import ensure_csrf_cookie


@login_required
@ensure_csrf_cookie  # the script sends this cookie back as X-CSRFToken on every API write
def index(request: HttpRequest) -> HttpResponse:
    """The page: the submit form, the live job, the history, and (staff) the queues panel."""
    host, _port = split_domain_port(request.get_host())  # Flower listens on the same host, its own port
    return render(
        request,
        "web/index.html",
        {
            "flower_url": f"{request.scheme}://{host}:{settings.FLOWER_PORT}/",
        },
    )


class LoginView(auth_views.LoginView):
    """Django's session login with the page's template; the same users as the admin."""

    template_name = "web/login.html"
    redirect_authenticated_user = True


class LogoutView(auth_views.LogoutView):
    """Sign out (a POST, as Django requires), back to the sign-in form."""
