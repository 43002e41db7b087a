"""What a module sends to Redis, one round trip at a time: for tests that hold a read to its number of trips."""

from __future__ import annotations

from typing import Any


def round_trips(monkeypatch: Any, module: Any, name: str = "client") -> list[list[str]]:
    """The commands `module`'s Redis client (`module.<name>()`, one client per process) sends, one list per round
    trip (a command, or a pipeline's). The client is wrapped once, and unwrapped when the test ends."""
    sent: list[list[str]] = []
    conn = getattr(module, name)()
    execute, make_pipeline = conn.execute_command, conn.pipeline

    def counted(*args, **options):
        sent.append([str(args[0]).upper()])
        return execute(*args, **options)

    def pipeline(*args, **options):
        pipe = make_pipeline(*args, **options)
        execute_pipe = pipe.execute

        def counted_pipe(*a, **o):
            sent.append([str(command[0]).upper() for command, _ in pipe.command_stack])
            return execute_pipe(*a, **o)

        pipe.execute = counted_pipe
        return pipe

    monkeypatch.setattr(conn, "execute_command", counted)
    monkeypatch.setattr(conn, "pipeline", pipeline)
    monkeypatch.setattr(module, name, lambda: conn)
    return sent
