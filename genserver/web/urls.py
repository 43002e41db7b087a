"""Routes of the web page: `/`, `/login/`, `/logout/`."""

from django.urls import path

from genserver.web import views

urlpatterns = [
    path("", views.index, name="web-index"),
    path("login/", views.LoginView.as_view(), name="web-login"),
    path("logout/", views.LogoutView.as_view(), name="web-logout"),
]
