"""Typed ZeroMQ wrappers.

Most sockets are owned by one IO thread that feeds (or drains) a queue: ZeroMQ sockets are not
thread-safe, and a busy loop must never block on a socket it does not need, so the main thread only
touches `queue.Queue`s (`Receiver[T]` decodes into its queue, `Sender[T]` sends the bytes its
callers encoded, so a message that cannot be encoded raises where it was sent). The step path is
the exception: the one socket a loop waits on (plans into a worker, results into the core) and the
sends that start the next step are done on the caller's thread (`StepReceiver[T]`,
`StepSender[T]`), because each thread hand-off costs a GIL switch per message.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import zmq

T = TypeVar("T")
logger = logging.getLogger("pagedserve.ipc")
_STOP = object()
# What decoding untrusted bytes may raise: msgspec's errors, and ValueError subclasses it lets
# through (invalid UTF-8 in a string raises UnicodeDecodeError). Any of them drops the frame.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)
_POLL_MS = 100


def ipc_dir() -> str:
    """A private (0700) directory for this engine's ipc:// socket files."""
    return tempfile.mkdtemp(prefix="pagedserve-")


def ipc_address(directory: str, name: str) -> str:
    return f"ipc://{os.path.join(directory, name)}"


@dataclass(frozen=True)
class CoreAddresses:
    """Where workers reach the core: its plan broadcast and its result socket."""

    plans: str
    results: str

    @classmethod
    def local(cls, directory: str) -> CoreAddresses:
        return cls(ipc_address(directory, "plans"), ipc_address(directory, "results"))

    @classmethod
    def tcp(cls, host: str, base_port: int) -> CoreAddresses:
        """Multi-node: the core binds base_port+1 and base_port+2 on the address the nodes use
        (traffic on them is CURVE-encrypted: ipc/curve.py)."""
        return cls(f"tcp://{host}:{base_port + 1}", f"tcp://{host}:{base_port + 2}")


def deliver_before_exit(timeout: float) -> None:
    """For a process about to exit on an error: give ZeroMQ's IO threads up to `timeout` seconds
    to deliver what closed sockets still hold (their linger). The interpreter's exit does not wait
    for them, so a worker's last message, its traceback, could be lost: the core then knew only
    that it exited. Terminating the context waits for those sends (and for any socket still
    open, hence the timeout)."""
    term = threading.Thread(target=zmq.Context.instance().term, daemon=True)
    term.start()
    term.join(timeout)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _socket(
    ctx: zmq.Context,
    kind: int,
    address: str,
    bind: bool,
    hwm: int = 0,
    options: dict[int, Any] | None = None,
) -> zmq.Socket:
    """`hwm`: messages queued per peer before a send blocks (PUSH) or drops (PUB); 0: no limit."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, 0)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class Receiver(Generic[T]):
    """PULL or SUB socket; an IO thread decodes each message as `msg_type` into `self.queue`.

    `on_message`, when given, is called on the IO thread with each decoded message instead of
    queueing it (the asyncio client uses it to hop onto its event loop).
    """

    def __init__(
        self,
        address: str,
        msg_type: Any,
        bind: bool,
        kind: int = zmq.PULL,
        on_message: Callable[[T], None] | None = None,
    ) -> None:
        self.address = address
        self.queue: queue.Queue[T] = queue.Queue()
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._on_message = on_message or self.queue.put
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sock = _socket(self._ctx, kind, address, bind)
        self._thread = threading.Thread(target=self._run, name=f"recv:{address}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            while True:
                try:
                    frame = self._sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    msg = self._decoder.decode(frame.buffer)
                except _DECODE_ERRORS as e:
                    logger.error(
                        "%s: dropped a frame that is not a valid message: %s", self.address, e
                    )
                    continue
                self._on_message(msg)

    def get(self, timeout: float | None = None) -> T | None:
        """The next message, or None after `timeout` seconds."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_nowait(self) -> T | None:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


class StepReceiver(Generic[T]):
    """A PULL or SUB socket read on the caller's thread: for the one socket a loop waits on.

    The step path (worker waiting for its next plan, core waiting for a step result) has nothing
    else to do while it waits, and a hand-off through an IO thread and a queue costs two thread
    wake-ups per message under the GIL; at one step every few milliseconds that is a measurable
    share of a decode step. Same `get` interface as `Receiver`.
    """

    def __init__(
        self,
        address: str,
        msg_type: Any,
        bind: bool,
        kind: int = zmq.PULL,
        options: dict[int, Any] | None = None,
    ) -> None:
        self.address = address
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._sock = _socket(zmq.Context.instance(), kind, address, bind, options=options)

    def get(self, timeout: float | None = None) -> T | None:
        """The next valid message, or None after `timeout` seconds (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if left is None else int(left * 1000)):
                return None
            frame = self._sock.recv(copy=False)
            try:
                return self._decoder.decode(frame.buffer)
            except _DECODE_ERRORS as e:
                logger.error("%s: dropped a frame that is not a valid message: %s", self.address, e)

    def get_nowait(self) -> T | None:
        return self.get(timeout=0)

    def close(self) -> None:
        self._sock.close(linger=0)


class Sender(Generic[T]):
    """PUSH or PUB socket; `send(msg)` encodes on the caller's thread and queues the bytes, an IO
    thread sends them in order. A message that cannot be encoded (a lone surrogate in a string)
    raises from `send`, to the caller that can answer for it, instead of vanishing on the IO
    thread (msgspec holds the GIL either way, so encoding here costs the caller nothing extra).

    Several connect addresses may share one sender (the core's PUSH to each client's PULL is one
    sender per client). For PUB with `wait_subscribers=n`, XPUB is used so `wait_ready` can block
    until n subscribers are attached (ZeroMQ drops PUB messages sent before a SUB has joined).

    `peer_timeout` (PUSH only): a peer that takes no message for that many seconds while `hwm`
    are queued (or that is gone: sends only go to live connections) is declared `gone`; the
    sender then drops everything, so a dead API server costs the core neither memory nor a
    blocked thread.
    """

    def __init__(
        self,
        address: str,
        bind: bool,
        kind: int = zmq.PUSH,
        hwm: int = 0,
        peer_timeout: float | None = None,
    ) -> None:
        self.address = address
        self.gone = False
        self._queue: queue.Queue[Any] = queue.Queue()
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context.instance()
        self._kind = zmq.XPUB if kind == zmq.PUB else kind
        options = {}
        if peer_timeout is not None:
            options = {zmq.IMMEDIATE: 1, zmq.SNDTIMEO: int(peer_timeout * 1000)}
        self._sock = _socket(self._ctx, self._kind, address, bind, hwm, options)
        if self._kind == zmq.XPUB:
            self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._subscribers = 0
        self._sub_lock = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"send:{address}", daemon=True)
        self._thread.start()

    def send(self, msg: T) -> None:
        """Raises TypeError or ValueError (UnicodeEncodeError) for a message msgpack cannot
        hold; nothing is queued then."""
        self._queue.put(self._encoder.encode(msg))

    def send_raw(self, payload: bytes) -> None:
        """Send already-encoded bytes (one encode for many senders of one broadcast)."""
        self._queue.put(payload)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def wait_subscribers(self, n: int, timeout: float) -> bool:
        with self._sub_lock:
            return self._sub_lock.wait_for(lambda: self._subscribers >= n, timeout=timeout)

    def _run(self) -> None:
        while True:
            if self._kind == zmq.XPUB:
                self._count_subscriptions()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
            else:
                item = self._queue.get()
            if item is _STOP:
                self._sock.close(linger=0)  # here: a socket belongs to one thread
                return
            if self.gone:
                continue
            try:
                self._sock.send(item)
            except zmq.Again:  # only with a peer_timeout: the peer is gone or stopped reading
                logger.warning("%s: the peer took nothing for a while; dropping it", self.address)
                self.gone = True

    def _count_subscriptions(self) -> None:
        while True:
            try:
                event = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if event[:1] == b"\x01":
                with self._sub_lock:
                    self._subscribers += 1
                    self._sub_lock.notify_all()

    def close(self, flush_timeout: float = 1.0) -> None:
        """Give queued messages up to `flush_timeout` seconds to leave; the IO thread closes the
        socket when it reaches the end of its queue (a send it is stuck in ends at the peer
        timeout, or with the process)."""
        self._queue.put(_STOP)
        self._thread.join(timeout=flush_timeout)


class StepSender(Generic[T]):
    """A PUSH or PUB socket written on the caller's thread: for the step path (plans out of the
    core, results out of the driver worker). Handing a message to an IO thread costs the sender a
    GIL hand-off while that thread encodes; measured with py-spy on a CPU decode loop, the worker
    spent most of a step's non-model time in that `Queue.put`. Encoding a plan and a non-blocking
    ZeroMQ send (no high-water mark) take microseconds, so they happen right here.

    PUB becomes XPUB so `wait_subscribers(n)` can count subscriptions: ZeroMQ drops PUB messages
    sent before a SUB has joined.
    """

    def __init__(
        self,
        address: str,
        bind: bool,
        kind: int = zmq.PUSH,
        hwm: int = 0,
        options: dict[int, Any] | None = None,
    ) -> None:
        self.address = address
        self._encoder = msgspec.msgpack.Encoder()
        self._kind = zmq.XPUB if kind == zmq.PUB else kind
        self._sock = _socket(zmq.Context.instance(), self._kind, address, bind, hwm, options)
        if self._kind == zmq.XPUB:
            self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._subscribers = 0

    def send(self, msg: T) -> None:
        self._sock.send(self._encoder.encode(msg))  # copy: zero-copy wakes pyzmq's gc thread

    def wait_subscribers(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._subscribers < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                return False
            if self._sock.recv()[:1] == b"\x01":
                self._subscribers += 1
        return True

    def drain_subscriptions(self) -> None:
        """Discard subscription messages that came after start-up (XPUB queues every one it
        gets, without a limit, for a reader; after `wait_subscribers` there is none)."""
        if self._kind != zmq.XPUB:
            return
        while True:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self, flush_timeout: float = 0.0) -> None:
        """Close, giving queued messages up to `flush_timeout` seconds to leave (as long as the
        process lives: before an `os._exit`, `deliver_before_exit` waits for them)."""
        self._sock.close(linger=int(flush_timeout * 1000))
