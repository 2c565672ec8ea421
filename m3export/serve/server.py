"""Run the ``tritonserver`` bundled in the ``nvidia-pytriton`` wheel on a model repository, and always stop it.

The wheel ships the server binary, the Python backend and one stub per Python version, but the stub is not
where the backend looks for it and the binary needs the wheel's private libraries. ``TritonServer`` lays out a
private backend directory (backend library + the stub for this Python), gives the stub a Python that works
(``stubenv``), binds HTTP, gRPC and metrics to free ports on 127.0.0.1, waits until the server *and* its models
are ready (the model is ready only once its engine is loaded), and on exit kills the whole process group, so no
stub outlives the server. ``python -m m3export.serve.server REPO`` does the same in the foreground.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import BackendUnavailable, M3Error
from .stubenv import libpython_dir, stub_env

INSTALL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0"


class ServerError(M3Error):
    """tritonserver did not start, or did not become ready in time; the message carries its log."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    python_backend: Path  # libtriton_python.so + triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub built for this Python
    libs: Path  # the wheel's private shared libraries


def find_tritonserver() -> TritonInstall:
    """The server inside the installed nvidia-pytriton wheel (located without importing pytriton, whose own
    dependencies we do not install)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailable(f"tritonserver is not installed: {INSTALL_HINT}")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    root = pkg / "tritonserver"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = TritonInstall(root / "bin" / "tritonserver", root / "backends" / "python",
                          root / "python_backend_stubs" / version / "triton_python_backend_stub",
                          pkg.parent / "nvidia_pytriton.libs")
    if not found.binary.is_file() or not (found.python_backend / "libtriton_python.so").is_file():
        raise BackendUnavailable(f"{root}: incomplete nvidia-pytriton installation; reinstall: {INSTALL_HINT}")
    if not found.stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise BackendUnavailable(f"nvidia-pytriton has no Python-backend stub for Python {version} "
                                 f"(it has {', '.join(have)}); serve from one of those Pythons")
    return found


# Thread stacks of tritonserver 2.51 are sized from RLIMIT_STACK; its HTTP request parser recurses per JSON
# element and overflows the usual 8 MiB on request bodies of a few MB (a known upstream crash, fixed in later
# releases): one large request would take the whole server down. 64 MiB serves a 10 MB body.
SERVER_STACK_BYTES = 64 << 20
_PR_SET_PDEATHSIG = 1


def _prepare_child() -> None:
    """Runs in the forked child before exec: a stack large enough for big request bodies, and death with its
    parent (SIGKILL when the process that started it dies, even by SIGKILL), so no server outlives its owner."""
    import ctypes
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    want = SERVER_STACK_BYTES if hard == resource.RLIM_INFINITY else min(SERVER_STACK_BYTES, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_STACK, (want, hard))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TritonServer:
    """Context manager: ``with TritonServer(repo) as server: ... server.http_url ...``.

    Ports left at None are picked free on ``host`` (and picked again if the server loses a race for one).
    ``workdir`` (backend directory and ``server.log``) is temporary and removed on stop unless given.
    """

    def __init__(self, repository: str | Path, *, host: str = "127.0.0.1", http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, startup_timeout: float = 180.0,
                 workdir: str | Path | None = None, log_verbose: int = 0):
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise ServerError(f"{self.repository}: model repository not found")
        self.host = host
        self._fixed = (http_port, grpc_port, metrics_port)
        fixed = [p for p in self._fixed if p is not None]
        if len(set(fixed)) != len(fixed):
            raise ServerError(f"HTTP, gRPC and metrics need different ports, got {self._fixed}")
        self.http_port = self.grpc_port = self.metrics_port = 0
        self.startup_timeout = startup_timeout
        self.log_verbose = log_verbose
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else None
        self._proc: subprocess.Popen | None = None
        self._log_start = 0
        self._exit_code: int | None = None
        self._shm_prefix = f"m3export_{uuid.uuid4().hex[:10]}_"

    # ------------------------------------------------------------------ addresses
    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "server.log"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except (OSError, AttributeError):
            return "(no server log)"
        # Triton prints wide option tables at startup; they bury the lines that explain a failure.
        kept = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("|", "+"))]
        return "\n".join(kept[-lines:])

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        install = find_tritonserver()
        env = self._environment(install)
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="m3export-triton-"))
        backends = self._backend_dir(install)
        try:
            for _ in range(3):
                self._pick_ports()
                self._launch(install, backends, env)
                if self._wait_ready():
                    return
                self._kill()
                if any(p is not None for p in self._fixed) or "already in use" not in self.log_tail(200):
                    break
            raise ServerError(f"tritonserver exited during startup (exit code {self._exit_code}) serving "
                              f"{self.repository}; last log lines:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._kill()
        for f in glob.glob(f"/dev/shm/{self._shm_prefix}*"):  # a killed stub cannot unlink its own regions
            Path(f).unlink(missing_ok=True)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    # ------------------------------------------------------------------ internals
    def _environment(self, install: TritonInstall) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(install.libs), str(libpython_dir()), env.get("LD_LIBRARY_PATH", "")) if p)
        env["PATH"] = os.pathsep.join(p for p in (str(stub_env() / "bin"), env.get("PATH", "")) if p)
        return env

    def _backend_dir(self, install: TritonInstall) -> Path:
        """The python backend runs the stub found next to its library; the wheel keeps stubs elsewhere."""
        python = self.workdir / "backends" / "python"
        python.mkdir(parents=True, exist_ok=True)
        for f in install.python_backend.iterdir():
            if f.is_file():
                shutil.copy2(f, python / f.name)
        shutil.copy2(install.stub, python / install.stub.name)
        return python.parent

    def _pick_ports(self) -> None:
        fixed = {p for p in self._fixed if p is not None}
        chosen: list[int] = []
        for port in self._fixed:
            if port is None:
                port = _free_port(self.host)
                while port in chosen or port in fixed:
                    port = _free_port(self.host)
            chosen.append(port)
        self.http_port, self.grpc_port, self.metrics_port = chosen

    def _launch(self, install: TritonInstall, backends: Path, env: dict[str, str]) -> None:
        cmd = [
            str(install.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--disable-auto-complete-config",  # our config.pbtxt is complete; this saves a stub start
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            "--exit-timeout-secs=10",
            f"--log-verbose={self.log_verbose}",
        ]
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=self.workdir, start_new_session=True,
                                          preexec_fn=_prepare_child)

    def _wait_ready(self) -> bool:
        """True once /v2/health/ready answers 200; False if the process died; ServerError on timeout."""
        deadline = time.monotonic() + self.startup_timeout
        url = f"{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and self._serving_http():
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise ServerError(f"tritonserver was not ready after {self.startup_timeout:.0f} s serving "
                          f"{self.repository}; last log lines:\n{self.log_tail()}")

    def _serving_http(self) -> bool:
        """Whether *our* process logged that it bound all three ports: a readiness answer alone may come from a
        server left on them by someone else (an orphan of a killed wrapper, say), while ours is failing on
        "address already in use"."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        started = (f"Started GRPCInferenceService at {self.host}:{self.grpc_port}",
                   f"Started HTTPService at {self.host}:{self.http_port}",
                   f"Started Metrics Service at {self.host}:{self.metrics_port}")
        return all(line in text for line in started) and self._proc.poll() is None

    def _kill(self) -> None:
        """SIGTERM lets Triton unload models (our engines stop their threads); SIGKILL if it takes too long."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # stubs left behind by a server that died are still in its process group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._exit_code = proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m m3export.serve.server",
        description="Serve a model repository written by 'm3export triton-repo' with the tritonserver bundled in "
                    "nvidia-pytriton, until interrupted.")
    parser.add_argument("repository")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    args = parser.parse_args(argv)

    def interrupt(*_):
        raise KeyboardInterrupt  # SIGTERM stops the server exactly as Ctrl-C does, during startup too

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        with TritonServer(args.repository, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, startup_timeout=args.startup_timeout) as server:
            print(f"serving {server.repository}\n  HTTP {server.http_url}  gRPC {server.grpc_url}  "
                  f"metrics {server.metrics_url}\n  log {server.log_path}", flush=True)
            while server.running:
                time.sleep(0.5)
            print(f"tritonserver exited; last log lines:\n{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        pass
    except M3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
