"""ZeroMQ CURVE for the plan and result sockets when they cross a network (`--nnodes` > 1).

Plans carry every prompt's token ids and results decide what the core appends, so between nodes
both are encrypted and authenticated. Every node gets the same key pair (`pagedserve gen-key`;
in Kubernetes a Secret): the core is the CURVE server with it, every worker a CURVE client with
it, and the core's ZAP handler admits only clients that prove they hold its secret half. A process
without the key can neither complete a handshake to read plans nor push a result.

The pair comes from `PAGEDSERVE_CURVE_KEY` (the 64 hex digits `gen-key` prints: the secret half,
from which the public half follows) or from a file named by `PAGEDSERVE_CURVE_KEY_FILE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq
import zmq.auth.thread
from zmq.utils import z85

from pagedserve.settings import CURVE_KEY_ENV as KEY_ENV
from pagedserve.settings import CURVE_KEY_FILE_ENV as KEY_FILE_ENV
from pagedserve.settings import curve_key_from_env


@dataclass(frozen=True)
class CurveKey:
    """A CURVE key pair, both halves Z85 (40 bytes). Its text is the secret half in hex: the
    public half follows from it, and hex needs no quoting in a shell or a manifest."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKey:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def parse(cls, text: str) -> CurveKey:
        try:
            raw = bytes.fromhex(text.strip())
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ValueError(
                "the CURVE key must be the 64 hex digits `pagedserve gen-key` prints "
                f"(in ${KEY_ENV}, or in the file ${KEY_FILE_ENV} names)"
            )
        secret = z85.encode(raw)
        return cls(zmq.curve_public(secret), secret)

    def text(self) -> str:
        return z85.decode(self.secret).hex()

    def server_options(self) -> dict[int, int | bytes]:
        return {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: self.secret, zmq.ZAP_DOMAIN: b"*"}

    def client_options(self) -> dict[int, int | bytes]:
        return {
            zmq.CURVE_SERVERKEY: self.public,
            zmq.CURVE_PUBLICKEY: self.public,
            zmq.CURVE_SECRETKEY: self.secret,
        }


def load_key() -> CurveKey:
    """The key pair every node was given; a clear error when there is none."""
    text, path = curve_key_from_env()
    if not text and path:
        with open(path) as f:
            text = f.read()
    if not text:
        raise ValueError(
            f"--nnodes > 1 needs a CURVE key pair on every node: run `pagedserve gen-key` once "
            f"and give its output to every node as ${KEY_ENV} (or a file named by ${KEY_FILE_ENV})"
        )
    return CurveKey.parse(text)


class _OneKey:
    """ZAP credentials: only the holder of the shared key pair is admitted."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def start_authenticator(key: CurveKey) -> zmq.auth.thread.ThreadAuthenticator:
    """Start the ZAP handler that CURVE server sockets of this process's context consult."""
    auth = zmq.auth.thread.ThreadAuthenticator(zmq.Context.instance())
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_OneKey(key.public))
    return auth
