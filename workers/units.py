"""A node's workers as systemd units or Procfile lines (`python -m workers.launcher --print --format ...`).

The launcher supervises its workers itself; on a production node systemd (or
a Procfile runner: honcho, foreman, a PaaS) can do it instead, one unit per
pool entry with the same command line and environment the launcher uses. The
cluster-wide settings (REDIS_URL, DATABASE_URL, the object store, the
registry) come from one environment file shared by every unit
(docs/DEPLOY.md); what differs per worker (its cards, queues, node name) is
written into its unit.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from genserver.scheduling.pools import PoolLayout

ENV_FILE = "/etc/genserver/genserver.env"


def _worker_lines(layout: PoolLayout, node: str, loglevel: str) -> list[tuple[str, dict[str, str], list[str]]]:
    from .launcher import cpu_threads_per_worker, worker_argv, worker_env

    threads = cpu_threads_per_worker(layout)
    return [
        (spec.name, {"GENSERVER_NODE": node, **worker_env(spec, threads)}, worker_argv(spec, loglevel, node))
        for spec in layout.workers
    ]


def systemd_units(layout: PoolLayout, node: str, loglevel: str, workdir: Path, user: str = "genserver") -> str:
    """One `genserver-worker-NAME.service` per pool entry, and `genserver-node.target` that starts them all."""
    parts = []
    names = []
    for name, env, argv in _worker_lines(layout, node, loglevel):
        unit = f"genserver-worker-{name}.service"
        names.append(unit)
        environment = "\n".join(f'Environment="{key}={value}"' for key, value in env.items())
        parts.append(f"""# --- {unit}
[Unit]
Description=genserver worker {name} on node {node}
After=network-online.target
Wants=network-online.target
PartOf=genserver-node.target

[Service]
Type=simple
User={user}
WorkingDirectory={workdir}
EnvironmentFile={ENV_FILE}
{environment}
ExecStart={shlex.join(argv)}
# A warm shutdown lets the running chunk finish; a chunk lasts GENSERVER_CHUNK_SECONDS.
KillSignal=SIGTERM
TimeoutStopSec=60
KillMode=control-group
Restart=always
RestartSec=2

[Install]
WantedBy=genserver-node.target
""")
    parts.append(f"""# --- genserver-node.target
[Unit]
Description=genserver GPU node {node}: every worker of its layout
Wants={" ".join(names)}

[Install]
WantedBy=multi-user.target
""")
    return "\n".join(parts)


def procfile(layout: PoolLayout, node: str, loglevel: str) -> str:
    """One Procfile line per pool entry: `gpu0: env CUDA_VISIBLE_DEVICES=0 ... python -m celery ...`."""
    lines = []
    for name, env, argv in _worker_lines(layout, node, loglevel):
        assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
        lines.append(f"{name.replace('-', '_')}: env {assignments} {shlex.join(argv)}")
    return "\n".join(lines) + "\n"
