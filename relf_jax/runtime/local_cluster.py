"""Several processes on one machine run as the hosts of one JAX multi-host job.

`run_local_cluster` starts N copies of a `relf-jax` command, each with the environment that
`relf_jax.runtime.sharding.init_distributed` reads (coordinator on a free local port, process
count, process id) and, on CPU, D simulated devices per process and the gloo collectives. It
forwards every line the processes print, prefixed with ``[pI]``; when one process exits with a
non-zero status (or is killed) it stops the others, since they would wait on it in their next
collective; it returns the first non-zero status, or 0 when all succeed. This is JAX's own
multi-controller runtime, exactly as on a pod: only the way the processes are started differs.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence, TextIO

from relf_jax.runtime.sharding import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

# how long the other processes get to exit after SIGTERM before they are killed
STOP_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, *, coordinator: str, processes: int, process_id: int,
                devices_per_process: int | None) -> dict:
    """The environment of process `process_id`: `base` plus the cluster's variables; with
    `devices_per_process`, that many simulated CPU devices and CPU collectives (gloo)."""
    env = {**base, COORDINATOR_ENV: coordinator, NUM_PROCESSES_ENV: str(processes),
           PROCESS_ID_ENV: str(process_id), "PYTHONUNBUFFERED": "1"}
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env.update({"JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                    "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])})
    return env


def run_local_cluster(args: Sequence[str], processes: int, devices_per_process: int | None = None, *,
                      out: TextIO | None = None, env: dict | None = None, cwd: str | None = None,
                      command: Sequence[str] | None = None) -> int:
    """Run ``relf-jax <args>`` as `processes` hosts of one job on this machine (see the module
    docstring). `command` replaces ``python -m experiments.launch`` (tests start other programs).
    Returns the first non-zero exit status (128 + N for a process killed by signal N), else 0."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
    out = out or sys.stdout
    base = dict(os.environ if env is None else env)
    coordinator = f"127.0.0.1:{free_port()}"
    argv = list(command or [sys.executable, "-m", "experiments.launch"]) + list(args)
    output = _Output(out)
    procs = []
    for i in range(processes):
        p = subprocess.Popen(argv, cwd=cwd, text=True, bufsize=1, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=process_env(base, coordinator=coordinator, processes=processes, process_id=i,
                                             devices_per_process=devices_per_process))
        threading.Thread(target=output.read, args=(i, p.stdout), daemon=True).start()
        procs.append(p)
    try:
        status = _wait(procs, output)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    while output.open_streams(len(procs)):  # what the processes printed before they exited
        output.forward(timeout=None)
    out.flush()
    return status


class _Output:
    """The processes' lines, read by one thread per process, written to `out` by the caller."""

    def __init__(self, out: TextIO):
        self.out, self.lines, self.ended = out, queue.Queue(), 0

    def read(self, i: int, stream) -> None:
        for line in stream:
            self.lines.put((i, line))
        self.lines.put((i, None))

    def forward(self, timeout: float | None) -> None:
        """Write the next line (prefixed with its process), waiting up to `timeout` for one."""
        try:
            i, line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return
        if line is None:
            self.ended += 1
        else:
            self.out.write(f"[p{i}] {line}" if line.endswith("\n") else f"[p{i}] {line}\n")

    def open_streams(self, total: int) -> int:
        return total - self.ended


def _wait(procs: list, output: _Output) -> int:
    """Forward output until every process has exited; on the first failure stop the rest."""
    status = 0
    while any(p.poll() is None for p in procs):
        output.forward(timeout=0.2)
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed and status == 0:
            code = failed[0].returncode
            status = 128 - code if code < 0 else code
            output.out.write(f"[launch-local] process {procs.index(failed[0])} exited with status {status}; "
                             "stopping the others\n")
            _stop(procs)
    return status


def _stop(procs: list) -> None:
    """SIGTERM to every process still running, SIGKILL to those still there after the grace."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
