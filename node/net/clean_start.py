"""hivemind's processes (the DHT's, a replica's averager's: each a multiprocessing.Process) started clean: by
multiprocessing's forkserver, a fresh interpreter that forks them on request, never forked from the daemon
amid gRPC's and CUDA's threads (whose locks a fork copies as they are, held or not).

What crosses to such a process is pickled: shared tensors and pipes by descriptor, the locks made in the
forkserver's context (multiprocessing refuses a fork context's), a started DHT as a client of its process
(its pipe, never the parent's handle of that process), and nothing only the parent uses. A process that dies
leaves no lock held that another waits on for ever: MPFuture's locks are each process's own, the few shared
values have none, and the parent waits for the shared vector's lock checking that its averager still runs.

The p2p daemon keeps an ended averager's protocol handlers (bound to that process's client socket) and refuses
to bind a protocol twice, so the averager that takes its place removes them first (`remove_handlers`)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import multiprocessing
import os
import signal
import sys
import time

import torch
from hivemind.dht import DHT
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, raise_if_failed, read_pbmsg_safe, write_pbmsg
from hivemind.proto import p2pd_pb2
from hivemind.utils import MPFuture
from hivemind.utils.multiaddr import Multiaddr

log = logging.getLogger("tahnode.averaging")

__all__ = ["CleanDHT", "CleanAverager", "ProcessEnded", "remove_handlers", "warm", "CONTEXT", "START_METHOD",
           "PRELOAD"]

START_METHOD = "forkserver"
CONTEXT = multiprocessing.get_context(START_METHOD)
# what the forkserver imports once (torch and hivemind among them), so that each process it forks starts at once
PRELOAD = ["tahnode.net.averaging_parts", "tahnode.net.dht_auth"]
CONTEXT.set_forkserver_preload(PRELOAD)
ADDRESS_BYTES = 512   # room for a client socket's multiaddr (/unix/tmp/hivemind-p2pclient-<id>.sock)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LIVENESS_S = 1.0      # while the parent waits for its averager's answer, how often it checks the process still runs
# a started DHT's attributes its clients use (its pipe, what it cached); the rest is its process's or the parent's
DHT_CLIENT = ("_outer_pipe", "_peer_id", "_client_mode", "_origin_pid", "_parent_pid", "_daemon_listen_maddr",
              "shutdown_timeout", "_name", "_identity")

# tensors cross by descriptor: the file_system strategy (hivemind's) needs torch's shm manager, which did not
# answer in time on a loaded machine
torch.multiprocessing.set_sharing_strategy("file_descriptor")


def warm() -> None:
    """Start the forkserver now (if it is not running), so that its imports overlap what this process does
    next; the first process it forks waits for them (seconds: torch, hivemind)."""
    from multiprocessing import forkserver

    forkserver.ensure_running()


class ProcessEnded(EOFError):
    """The averager's process ended while its parent waited for an answer."""


def _Popen(process_obj):
    return CONTEXT.Process._Popen(process_obj)


def _parent_state(state: dict) -> dict:
    """`state` with what the new process takes of its parent's: the root logger's level and format."""
    root = logging.getLogger()
    formatter = root.handlers[0].formatter if root.handlers else None
    return dict(state, _from_parent=(root.level, formatter._fmt if formatter else None))


def _die_with_forkserver() -> None:
    """(Linux, an averager's process.) The kernel ends it when the forkserver that forked it ends (as it does
    when the daemon ends, however): no averager outlives its daemon (the DHT's process has the daemon's reaper),
    and none whose forkserver ended (its parent then cannot tell that it runs, and starts another) runs on."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _enter_child(state: dict) -> dict:
    """(In the new process, unpickling.) Its parent's logging, the sharing strategy, MPFuture's locks of its
    own; SIGINT left to the parent (which shuts its processes down); `state` without them."""
    state = dict(state)
    level, fmt = state.pop("_from_parent")
    # hivemind's MPFuture takes locks that the processes forked from one share (to make a future, to write a
    # result): held by one killed meanwhile (an averager that dies), they would stop every other for good
    MPFuture.reset_backend()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if fmt is not None and not logging.getLogger().handlers:
        logging.basicConfig(level=level, format=fmt)
    return state


class ParentOnly:
    """What stands in a started process for a part only its parent uses (the replica's state, a thread lock):
    it is there (`is None` says what it says in the parent) but never to be called."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is used in the averager's parent process only")


def dht_client(dht: DHT) -> DHT:
    """A started `dht` as another process uses it: its pipe to the DHT's process and what it cached (peer id,
    client mode); never the parent's handle of that process (not picklable), nor its start arguments."""
    client = object.__new__(type(dht))
    client.__dict__.update({name: value for name, value in vars(dht).items() if name in DHT_CLIENT})
    client._popen, client._p2p_replica, client._config, client._closed = None, None, {}, False
    return client


class CleanDHT(DHT):
    """hivemind's DHT, its process started by CONTEXT (hivemind's own class forks it)."""

    _Popen = staticmethod(_Popen)

    def __getstate__(self) -> dict:
        return _parent_state(vars(self))

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(_enter_child(state))


async def remove_handlers(p2p, names: list[str], at: str) -> int:
    """Unbind protocols `names` from the client socket `at` in `p2p`'s daemon (an ended process's handlers:
    the daemon dials a socket nobody listens on, and refuses the protocol to anyone else); how many it held."""
    removed, address = 0, Multiaddr(at)
    for name in names:
        reader, writer = await p2p._client.control.daemon_connector.open_connection()
        request = p2pd_pb2.Request(type=p2pd_pb2.Request.REMOVE_STREAM_HANDLER, removeStreamHandler=(
            p2pd_pb2.RemoveStreamHandlerRequest(addr=address.to_bytes(), proto=[name])))
        try:
            await write_pbmsg(writer, request)
            response = p2pd_pb2.Response()
            await read_pbmsg_safe(reader, response)
            raise_if_failed(response)
            removed += 1
        except ControlFailure:  # not bound there: the ended process had not bound it yet
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    with contextlib.suppress(OSError, ValueError):
        os.remove(address.value_for_protocol("unix"))  # the ended process's socket file
    return removed


class CleanAverager:
    """For a DecentralizedAverager subclass (before it among the bases): its process started by CONTEXT, what
    `parent_only` names left behind (a ParentOnly in its place); `replaces`: where an ended averager of the
    same prefix on this peer had its handlers (that process's client socket), removed before this one binds
    its own."""

    parent_only: tuple[str, ...] = ()
    _Popen = staticmethod(_Popen)

    def _start_cleanly(self, replaces: str = "") -> None:
        """(At the end of __init__.) hivemind's locks and shared values made anew in CONTEXT."""
        self.lock_averaged_tensors = CONTEXT.Lock()
        # shared without locks (a process that died holding one would leave it held): flags, and an address
        # written once at the start
        self._allow_state_sharing = CONTEXT.Value(ctypes.c_bool, self._allow_state_sharing.value, lock=False)
        self._state_sharing_priority = CONTEXT.Value(ctypes.c_double, self._state_sharing_priority.value, lock=False)
        self._handlers_at = CONTEXT.Array(ctypes.c_char, ADDRESS_BYTES, lock=False)
        self.replaces = replaces

    @property
    def handlers_at(self) -> str:
        """The client socket its process bound its handlers to ("" until it did)."""
        return self._handlers_at.value.decode()

    def answer(self, future: MPFuture, timeout: float):
        """(Parent.) `future`'s result within `timeout` s (TimeoutError after), ProcessEnded as soon as its
        process is found ended."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=max(0.0, min(LIVENESS_S, deadline - time.monotonic())))
            except TimeoutError:
                if not self.is_alive():
                    raise ProcessEnded(f"the averager of {self.prefix} ended (exit code {self.exitcode})") from None
                if time.monotonic() >= deadline:
                    raise

    @contextlib.contextmanager
    def get_tensors(self):
        """As hivemind's; in the parent, ProcessEnded rather than waiting for ever on the lock of a process that
        ended holding it (in the middle of an all-reduce)."""
        if os.getpid() != self._parent_pid:
            with self.lock_averaged_tensors:
                yield self._averaged_tensors
            return
        while not self.lock_averaged_tensors.acquire(timeout=LIVENESS_S):
            if not self.is_alive():
                raise ProcessEnded(f"the averager of {self.prefix} ended (exit code {self.exitcode})")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """(Parent.) As hivemind's, but ProcessEnded as soon as the process is found ended."""
        self.answer(self._ready, math.inf if timeout is None else timeout)

    def release(self) -> None:
        """(Parent, its process ended.) The thread that served that process the replica's state told to end."""
        with contextlib.suppress(OSError):
            self._inner_pipe.send(("_SHUTDOWN", None))

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace: str | None = None, balanced: bool = False):
        """(In its process.) The ended averager's handlers removed, then its own bound (and where, kept)."""
        self._collect_rpc_handlers()
        if self.replaces:
            names = [self._get_handle_name(namespace, handler.method_name) for handler in self._rpc_handlers]
            removed = await remove_handlers(p2p, names, self.replaces)
            log.info("averaging %s: removed %d handlers of the ended averager", self.prefix, removed)
        self._handlers_at.value = str(p2p._client_listen_maddr).encode()
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)

    def __getstate__(self) -> dict:
        state = {name: ParentOnly(name) if name in self.parent_only and value is not None else value
                 for name, value in vars(self).items()}
        return _parent_state(dict(state, dht=dht_client(self.dht)))

    def __setstate__(self, state: dict) -> None:
        _die_with_forkserver()
        self.__dict__.update(_enter_child(state))
