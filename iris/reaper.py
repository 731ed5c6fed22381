"""Nothing left behind: when a process dies, however it dies, every process it started dies too.

A process that starts services (``iris dev``, a test session) tears them down when it stops normally
or on SIGINT/SIGTERM. SIGKILL, an OOM kill or a crash skip that teardown, and its children (the
Temporal server, the emulators, the controllers, a Ray head, the jobs those started) would run on as
orphans. ``watch()`` starts a small watchdog process beside the caller (docs/DESIGN.md, "Nothing left
behind"). While the caller lives, the watchdog records every process descended from it, by pid and
start time, every ``INTERVAL_S``. Once the caller is gone, it kills each recorded process still
alive, and any process whose parent, process group or session is one of them. That covers
processes that started their own session (services, jobs), were orphaned when their parent died,
or were started by an orphan.

Only processes the caller's tree held are touched. A pid is trusted only with the start time
recorded with it (so a reused pid is never killed), and the caller's own process group and session
are never used as a selector (they hold its parent, e.g. the shell or ``uv run``). A process
started and orphaned within the last ``INTERVAL_S`` before the caller's death, in a session of its
own, can escape; nothing else does.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# How often the watchdog records the caller's descendants.
INTERVAL_S = 0.5
# How long the watchdog keeps killing after the caller is gone (a dying process may still fork).
SWEEP_S = 10.0


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int  # clock ticks since boot: with the pid, names one process for good


def read_proc(pid: int) -> ProcInfo | None:
    """One process's parent, group, session and start time from /proc; None if it is gone.
    Plain os calls: the watchdog reads every process's stat twice a second, for as long as its
    caller lives (half the CPU of ``Path.read_bytes``, measured)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = raw[raw.rindex(b")") + 2 :].split(None, 20)
    if fields[0] in (b"Z", b"X"):  # a zombie has ended; only its parent's wait is left
        return None
    return ProcInfo(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def snapshot() -> dict[int, ProcInfo]:
    """Every live process on the machine."""
    procs: dict[int, ProcInfo] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                procs[info.pid] = info
    return procs


def descendants(roots: set[int], procs: dict[int, ProcInfo]) -> set[int]:
    """The pids in ``procs`` below any of ``roots`` (the roots themselves excluded)."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child not in roots:
                found.add(child)
                stack.append(child)
    return found


class Watchdog:
    """The watchdog's state: the caller, and every process seen below it."""

    def __init__(self, target: ProcInfo) -> None:
        self.target = target
        self.known: dict[int, int] = {}  # pid -> start time

    @staticmethod
    def alive(procs: dict[int, ProcInfo], pid: int, start: int) -> bool:
        p = procs.get(pid)
        return p is not None and p.start == start

    def caller_alive(self, procs: dict[int, ProcInfo]) -> bool:
        return self.alive(procs, self.target.pid, self.target.start)

    def record(self, procs: dict[int, ProcInfo]) -> None:
        """Add the caller's descendants, and those of every recorded process (orphans included)."""
        self.known = {pid: start for pid, start in self.known.items() if self.alive(procs, pid, start)}
        roots = {self.target.pid, *self.known}
        for pid in descendants(roots, procs):
            self.known.setdefault(pid, procs[pid].start)

    def leftovers(self, procs: dict[int, ProcInfo]) -> set[int]:
        """What must die: recorded processes still alive, their descendants, and their groups and
        sessions (never the caller's own, which hold its parent)."""
        self.record(procs)
        live = set(self.known)
        groups = {procs[pid].pgid for pid in live} - {self.target.pgid}
        sessions = {procs[pid].sid for pid in live} - {self.target.sid}
        live |= {p.pid for p in procs.values() if p.pgid in groups or p.sid in sessions}
        live.discard(self.target.pid)
        live.discard(os.getpid())
        return live

    def sweep(self) -> int:
        """Kill every leftover until none is left (or SWEEP_S passed); how many were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + SWEEP_S
        while time.monotonic() < deadline:
            procs = snapshot()
            doomed = self.leftovers(procs)
            if not doomed:
                break
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                self.known.setdefault(pid, procs[pid].start)
            killed |= doomed
            time.sleep(0.1)
        return len(killed)


def run(target_pid: int) -> int:
    """The watchdog's loop (``python -m iris.reaper PID``): its stdin is a pipe from the caller,
    which closes when the caller dies."""
    target = read_proc(target_pid)
    if target is None:
        return 0
    dog = Watchdog(target)
    stdin = sys.stdin.buffer
    while True:
        procs = snapshot()
        if not dog.caller_alive(procs):
            break
        dog.record(procs)
        ready, _, _ = select.select([stdin], [], [], INTERVAL_S)
        # EOF: the caller died (or closed the pipe on its way out); either way it is going.
        if ready and not os.read(stdin.fileno(), 4096):
            while dog.caller_alive(snapshot()):
                time.sleep(0.05)
            break
    dog.sweep()
    return 0


_started: subprocess.Popen[bytes] | None = None


def watch() -> None:
    """Start this process's watchdog (once; later calls do nothing). Linux only (/proc)."""
    global _started
    if _started is not None or not Path("/proc/self/stat").exists():
        return
    _started = subprocess.Popen(
        [sys.executable, "-m", "iris.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a signal to the caller's process group (Ctrl-C) does not reach it.
        start_new_session=True,
        close_fds=True,
    )


if __name__ == "__main__":
    sys.exit(run(int(sys.argv[1])))
