"""The transports by name (``TransferConfig.transport``) and ``make_transport``.

Kept apart from ``transport.py`` (the interface every implementation imports) so the
interface never imports its implementations back: the factory sits above them all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtransfer.config import TransferConfig
from kvtransfer.errors import TransferError
from kvtransfer.loopback import LoopbackTransport
from kvtransfer.tcp import TcpTransport
from kvtransfer.transport import Transport
from kvtransfer.ucx import UcxTransport, UcxUnavailable
from kvtransfer.ucx_puts import PutPolicy

log = logging.getLogger(__name__)


def _ucx(config: TransferConfig) -> Transport:
    # A grant lets the sender start writing for half the receiver's drain grace:
    # blocks of a failed transfer are released only after that grace.
    policy = PutPolicy(config.ucx_put_share, config.ucx_put_min_bytes, config.drain_grace_s / 2)
    try:
        return UcxTransport(policy=policy)
    except UcxUnavailable as e:
        if not config.allow_fallback:
            raise TransferError(
                f"{e}. Install the UCX extra (pip install 'pdserve[ucx]'), or choose "
                "the tcp transport, or allow falling back to it"
            ) from None
        log.warning("%s; falling back to the TCP KV transport (several times slower)", e)
        return TcpTransport(config.drain_grace_s)


TRANSPORTS: dict[str, Callable[[TransferConfig], Transport]] = {
    "ucx": _ucx,  # the default; TCP only if UCX is missing and the config allows falling back
    "tcp": lambda config: TcpTransport(config.drain_grace_s),
    "loopback": lambda _config: LoopbackTransport(),
}


def make_transport(config: TransferConfig) -> Transport:
    """The configured transport (the name was validated by TransferConfig)."""
    return TRANSPORTS[config.transport](config)
