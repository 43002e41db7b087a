"""A fork server for the workers: torch, diffusers and Celery imported once, each worker forked from that.

A Celery worker's start is mostly imports: about 3 CPU-s on a 2-core machine, two
thirds of it torch and diffusers, more with a model's first load (the pipelines
import lazily). The supervisor restarts workers after a crash, and a test run
starts about fifty, so the zygote imports those libraries once and forks each
worker from them: a start then costs Django's setup and Celery's bootsteps, and
the children share the imported pages copy-on-write.

What the zygote imports is what no environment variable changes (third-party
libraries only, never Django's settings or genserver's modules), so a forked
worker still reads its own environment: the request carries the child's whole
environment, its working directory and its stdio descriptors (SCM_RIGHTS), and
the child runs `python -m MODULE ARGS` as a fresh process would. Only argv of that
form whose PYTHON* variables match the zygote's (sys.path, hash seed) are forked;
anything else is started with Popen.

The zygote never touches CUDA: forking after the CUDA driver is initialised
breaks the child's CUDA. It checks torch's state before each fork and refuses
(the caller starts the child itself) if something did. GPU hosts keep Popen by
default (GENSERVER_WORKER_FORKSERVER, docs/CONFIGURATION.md) until the GPU check
has run it.

Protocol, over an AF_UNIX SOCK_SEQPACKET pair (one JSON message per packet):
  zygote → {"ready": true}                          once, after the imports
  caller → {"argv": [...], "env": {...}, "cwd": ...} with fds 0, 1, 2 attached
  zygote → {"pid": N} or {"error": "..."}
  zygote → {"exited": N, "returncode": R}            whenever a child exits (R as Popen's)
The zygote exits when the caller's end closes; its children live on, as Popen's would.

Over 400 lines: both ends of one protocol (the zygote's loop and the caller's Popen-like handle) stay in one
file, so a change to a message changes both sides together.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

log = logging.getLogger("genserver.zygote")

# The modules a worker imports at start or at a model's first load, none of which reads the environment
# as it is imported. A name after ':' is an attribute of a lazy package (diffusers, transformers) whose
# access imports its submodule. One that fails to import is skipped: the worker imports it itself.
PRELOAD: tuple[str, ...] = (
    "numpy",
    "torch",
    "PIL.Image",
    "PIL.PngImagePlugin",
    "av",
    "safetensors.torch",
    "redis",
    "kombu.transport.redis",
    "celery.apps.worker",
    "celery.worker.consumer",
    "celery.concurrency.solo",
    "django.db.models",
    "rest_framework.serializers",
    "diffusers:AutoencoderKL",
    "diffusers:AutoencoderKLWan",
    "diffusers:UNet2DConditionModel",
    "diffusers:FluxTransformer2DModel",
    "diffusers:WanTransformer3DModel",
    "diffusers:StableDiffusionPipeline",
    "diffusers:StableDiffusionXLPipeline",
    "diffusers:FluxPipeline",
    "diffusers:WanPipeline",
    "diffusers:EulerDiscreteScheduler",
    "diffusers:FlowMatchEulerDiscreteScheduler",
    "diffusers:UniPCMultistepScheduler",
    "diffusers:DPMSolverMultistepScheduler",
    "transformers:CLIPTextModel",
    "transformers:CLIPTextModelWithProjection",
    "transformers:CLIPTokenizer",
    "transformers:T5EncoderModel",
    "transformers:T5Tokenizer",
    "transformers:UMT5EncoderModel",
)
MESSAGE_BYTES = 1 << 20  # one packet: a child's argv and environment
READY_SECONDS = 120.0  # the imports on a busy 2-core machine; past this the caller starts children itself
UNKNOWN_EXIT = 255  # a child's status when the zygote died before reporting it (init reaped it)


# --- The zygote process ---------------------------------------------------------------------------


def preload(names: Sequence[str] = PRELOAD) -> list[str]:
    """Import `names` (module, or module:attribute); return those that failed."""
    failed = []
    for name in names:
        module, _, attribute = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if attribute:
                getattr(imported, attribute)
        except Exception:  # noqa: BLE001 - an optional library, or a version without this class: the worker imports it
            failed.append(name)
    return failed


def unfit_to_fork() -> str:
    """Why this process must not fork workers now ('' when it may): state a child must build for itself."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA initialised in the zygote (a forked child's driver would be broken)"
    conf = sys.modules.get("django.conf")
    if conf is not None and conf.settings.configured:
        return "Django's settings read in the zygote (a child must read its own environment)"
    ours = sorted(m for m in sys.modules if m.partition(".")[0] in ("genserver", "tasks") or m == "workers.runtime")
    if ours:
        return f"the service's own modules imported in the zygote ({', '.join(ours[:3])})"
    return ""


def serve(control: socket.socket) -> None:
    """The zygote's loop: fork a child per request, report each child's exit, return when the caller leaves."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select through the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the caller's terminal: the caller stops us
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([control, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(control, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if control not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 3)
        if not message:  # the caller closed its end
            return
        request = json.loads(message)
        refusal = unfit_to_fork() or ("" if len(fds) == 3 else "the request came without its stdio fds")
        if refusal:
            for fd in fds:
                os.close(fd)
            _send(control, {"error": refusal})
            continue
        sys.stderr.flush()  # nothing buffered here may be written twice, by the child too
        pid = os.fork()
        if pid == 0:
            os.close(wake_r)
            os.close(wake_w)
            _run_child(control, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(control, {"pid": pid})


def _run_child(control: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m MODULE ARGS` in the request's environment, then exit."""
    code = 1
    try:
        control.close()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
        os.setsid()  # its own process group, as Popen(start_new_session=True): killpg reaches it and its pool
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts its working directory first
        _fresh_process_state(request["env"])
        module, args = request["argv"][2], request["argv"][3:]
        sys.argv = [module, *args]
        _retitle(request["argv"])
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever ended the child is printed, as the interpreter would
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # a closed stdio: nothing more to say
                pass
        os._exit(code)


def _fresh_process_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would have differently from its forked copy: random state and torch's threads."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # torch read OMP_NUM_THREADS when the zygote imported it


def _retitle(argv: Sequence[str]) -> None:
    """Show the child's own command line in ps and top, not the zygote's (Celery retitles it once it runs)."""
    try:
        import setproctitle
    except ImportError:  # ps shows `python -m workers.zygote` for every worker: cosmetic
        return
    import shlex

    setproctitle.setproctitle(shlex.join(argv))


def _send(control: socket.socket, message: dict) -> None:
    try:
        control.send(json.dumps(message).encode())
    except OSError:  # the caller is gone: the next recv sees it
        pass


def main() -> None:
    """`python -m workers.zygote FD [MODULE ...]`: serve on socket FD after importing MODULEs (default PRELOAD)."""
    control = socket.socket(fileno=int(sys.argv[1]))
    failed = preload(sys.argv[2:] or PRELOAD)
    if failed:
        print(f"zygote: not preloaded (the workers import them): {', '.join(failed)}", file=sys.stderr)
    refusal = unfit_to_fork()
    if refusal:
        print(f"zygote: will not fork: {refusal}", file=sys.stderr)
    _send(control, {"ready": not refusal})
    serve(control)


# --- The caller's side ----------------------------------------------------------------------------


class ForkedProcess:
    """A child forked by the zygote, with the part of subprocess.Popen's interface the supervisor uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.returncode


class Zygote:
    """The caller's handle on one zygote process: `spawn` forks a child, or returns None (use Popen)."""

    def __init__(self, modules: Sequence[str] = PRELOAD) -> None:
        """Start a zygote importing `modules` (module or module:attribute, as PRELOAD)."""
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.zygote", str(theirs.fileno()), *modules],
            pass_fds=[theirs.fileno()],
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops the children
        )
        theirs.close()
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._ready: bool | None = None  # None: not heard from yet; False: unusable
        self._gone = False  # its end of the socket closed: it exited
        self._python_env = _python_env(os.environ)

    def accepts(self, argv: Sequence[str], env: dict[str, str]) -> bool:
        """Whether this child can be forked: `python -m MODULE ...` with this interpreter and our PYTHON*."""
        return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and _python_env(env) == self._python_env

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str | None = None) -> ForkedProcess | None:
        """Fork `argv` in `env` with this process's stdio; None when the zygote cannot (start it with Popen)."""
        if not self.accepts(argv, env):
            return None
        with self._lock:
            if not self._wait_ready():
                return None
            request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd or os.getcwd()}).encode()
            try:
                socket.send_fds(self._control, [request], [0, 1, 2])
                reply = self._next_reply()
            except OSError:
                reply = None
            if reply is None or "pid" not in reply:
                log.warning("zygote could not fork %s (%s): starting it directly", argv[2], reply or "it exited")
                self._ready = False  # what stops it forking now stops it for good: don't ask again
                return None
            return ForkedProcess(self, reply["pid"])

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status once the zygote reports it, waiting up to `timeout` (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._gone:
                    status = self._orphan_status(pid)
                    if status is not None or left == 0.0:
                        return status
                    time.sleep(min(0.1, left if left is not None else 0.1))
                elif not select.select([self._control], [], [], left)[0]:
                    return None
                else:
                    self._read_one()
            return self._exits[pid]

    def close(self) -> None:
        """Stop the zygote (its children live on, and their exits are no longer reported)."""
        self._ready, self._gone = False, True
        self._control.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _wait_ready(self) -> bool:
        if self._ready is None:
            deadline = time.monotonic() + READY_SECONDS
            while self._ready is None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._control], [], [], left)[0]:
                    log.warning("zygote not ready after %.0f s: starting workers directly", READY_SECONDS)
                    self._ready = False
                else:
                    self._read_one()
        return bool(self._ready)

    def _next_reply(self) -> dict | None:
        """Read until the answer to a spawn request, keeping the exit reports that come before it."""
        while True:
            message = self._read_one()
            if message is None:
                return None
            if "pid" in message or "error" in message:
                return message

    def _read_one(self) -> dict | None:
        """One message (an exit report is recorded as it is read); None when the zygote is gone."""
        try:
            data = self._control.recv(MESSAGE_BYTES)
        except OSError:
            data = b""
        if not data:
            self._ready, self._gone = False, True
            return None
        message = json.loads(data)
        if "exited" in message:
            self._exits[message["exited"]] = message["returncode"]
        elif "ready" in message:
            self._ready = bool(message["ready"])
        return message

    def _orphan_status(self, pid: int) -> int | None:
        """The zygote died: its children were handed to init (or a subreaper); only liveness is left."""
        try:
            with open(f"/proc/{pid}/stat") as stat:
                ended = stat.read().rpartition(")")[2].split()[0] in ("Z", "X")  # a zombie nobody reaps
        except FileNotFoundError:
            ended = True
        if ended:
            self._exits[pid] = UNKNOWN_EXIT
            return UNKNOWN_EXIT
        return None


def _python_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared() -> Zygote:
    """This process's zygote, started on first use (its imports overlap whatever the caller does next)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.process.poll() is not None:
            _shared = Zygote()
            import atexit

            atexit.register(_shared.close)
        return _shared


if __name__ == "__main__":
    main()
