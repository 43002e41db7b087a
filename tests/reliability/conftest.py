"""Helpers of the fault drills: API clients for the chaos harness, a cuttable TCP proxy, worker revival."""

from __future__ import annotations

import json
import os
import select
import socket
import threading
from typing import Any

import pytest


def django_api(client) -> Any:
    """A DRF test client as the chaos harness's API callable: (method, path, body) → (status, json, headers)."""

    def call(method: str, path: str, body: Any = None) -> tuple[int, Any, dict]:
        if method == "POST":
            response = client.post(
                path, data=json.dumps(body) if body is not None else None, content_type="application/json"
            )
        else:
            response = client.get(path)
        try:
            data = response.json()
        except (ValueError, TypeError):
            data = None
        return response.status_code, data, dict(response.items())

    return call


def revive(stack) -> None:
    """Restart every worker the drills killed, at once (the kills are ours, not a crash loop)."""
    from bench.chaos import revive as revive_now

    revive_now(stack.supervisor)
    stack.wait_ready()


def using_postgres() -> bool:
    from django.conf import settings

    return settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


def bundled_redis_pid() -> int | None:
    """The pid of the Redis server when it is this test session's own (tests/settings.py started it)."""
    from genserver.redis_client import client

    pid = int(client().info("server")["process_id"])
    try:
        with open(f"/proc/{pid}/stat") as fh:
            parent = int(fh.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None
    return pid if parent == os.getpid() else None


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; `cut()` drops every connection and refuses new ones
    (the database "goes away"), `restore()` listens again on the same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 1.0)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (b if sock is a else a).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for sock in (a, b):
                try:
                    sock.close()
                except OSError:
                    pass

    def cut(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    sock.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.cut()


@pytest.fixture
def user_with_token(django_user_model):
    """(user, APIClient authenticated by a real token header): the whole auth path runs, database included."""
    from rest_framework.test import APIClient

    from genserver.jobs.services import tokens

    def make(username: str, staff: bool = False):
        user = django_user_model.objects.create_user(username=username, is_staff=staff)
        return user, APIClient(HTTP_AUTHORIZATION=f"Token {tokens.issue(user)[1]}")

    return make
