"""The typed ZeroMQ wrappers on hostile or dead peers: a client that went away or stopped reading
is declared gone (the core drops its sender), undecodable frames are dropped."""

from __future__ import annotations

import shutil
import time

import zmq

from pagedserve.ipc.messages import CoreToClient, EngineDead
from pagedserve.ipc.sockets import Receiver, Sender, ipc_address, ipc_dir


def wait_gone(sender: Sender, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not sender.gone:
        assert time.monotonic() - start < timeout, "the sender never gave up on its peer"
        sender.send(EngineDead("x" * 10_000))
        time.sleep(0.05)
    return time.monotonic() - start


def test_sender_gives_up_on_a_dead_or_stalled_peer():
    directory = ipc_dir()
    try:
        dead = ipc_address(directory, "dead")
        receiver: Receiver = Receiver(dead, CoreToClient, bind=True)
        sender: Sender = Sender(dead, bind=False, hwm=4, peer_timeout=0.3)
        sender.send(EngineDead("hello"))
        assert receiver.get(timeout=5) == EngineDead("hello")
        assert not sender.gone
        receiver.close()  # the API server died
        assert wait_gone(sender) < 5
        sender.close()

        stalled = ipc_address(directory, "stalled")  # alive but never reads (SIGSTOPped)
        ctx = zmq.Context.instance()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 1)
        pull.bind(stalled)
        sender = Sender(stalled, bind=False, hwm=4, peer_timeout=0.3)
        assert wait_gone(sender) < 8
        sender.close()
        pull.close(linger=0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_undecodable_frames_are_dropped_and_the_thread_lives():
    directory = ipc_dir()
    try:
        address = ipc_address(directory, "in")
        receiver: Receiver = Receiver(address, CoreToClient, bind=True)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        for frame in [b"\x92\xaaEngineDead\xa2\xff\xfe", b"\xc1", b"\x91" * 5000, b""]:
            push.send(frame)  # invalid UTF-8 (a UnicodeDecodeError), reserved byte, deep, empty
        push.send(Sender(address, bind=False).encode(EngineDead("still here")))
        assert receiver.get(timeout=5) == EngineDead("still here")
        push.close(linger=0)
        receiver.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# A worker's last words: send, close with a linger, wait for delivery, then exit at once.
LAST_WORDS = """
import os, sys
from pagedserve.ipc.messages import WorkerError
from pagedserve.ipc.sockets import StepSender, deliver_before_exit
sender = StepSender(sys.argv[1], bind=False)
sender.send(WorkerError(0, "x" * 4_000_000))
sender.close(flush_timeout=2.0)
if sys.argv[2] == "deliver":
    deliver_before_exit(timeout=2.0)
os._exit(1)
"""


def test_a_message_sent_just_before_exit_arrives():
    """ZeroMQ sends from its own thread, which a process's exit does not wait for: a worker's
    traceback, sent just before it exits, arrives only if `deliver_before_exit` waits for it
    (CI once reported a failed worker only as "exited with code 1")."""
    import subprocess
    import sys

    from pagedserve.ipc.messages import WorkerError, WorkerToCore
    from pagedserve.ipc.sockets import StepReceiver

    directory = ipc_dir()
    try:
        address = ipc_address(directory, "results")
        receiver: StepReceiver = StepReceiver(address, WorkerToCore, bind=True)
        for _ in range(3):
            subprocess.run([sys.executable, "-c", LAST_WORDS, address, "deliver"], check=False)
            msg = receiver.get(timeout=5.0)
            assert isinstance(msg, WorkerError) and len(msg.message) == 4_000_000
        receiver.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
