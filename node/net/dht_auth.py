"""Members only in the swarm's hivemind DHT: every DHT request and response carries an HMAC made with
the swarm key (`SwarmAuthorizer`, hivemind's `AuthorizerBase`), so a peer without the token can neither
read, write nor answer anything there, whatever run id it knows.

A request's MAC covers the whole request (its time and a random nonce included); a servicer refuses one
off its clock by more than CLOCK_WINDOW_S or whose nonce it saw within the window (a replay). A response's
MAC covers the response and the request's nonce, so an answer is good for its own request only."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from .auth import SwarmKey
from .freshness import CLOCK_WINDOW_S

__all__ = ["SwarmAuthorizer", "NONCE_BYTES"]

NONCE_BYTES = 16
REQUEST, RESPONSE = b"tahnode dht request\0", b"tahnode dht response\0"


def _mac(key: bytes, domain: bytes, message) -> bytes:
    """The HMAC of `message` with an empty signature (what the signature covers)."""
    signature, message.auth.signature = message.auth.signature, b""
    data = message.SerializeToString(deterministic=True)
    message.auth.signature = signature
    return hmac.new(key, domain + data, hashlib.sha256).digest()


class SwarmAuthorizer(AuthorizerBase):
    """Signs and checks DHT requests and responses with the swarm key (tahnode.net.auth.SwarmKey)."""

    def __init__(self, key: SwarmKey):
        self.key = hashlib.sha256(b"tahnode dht\0" + key.key).digest()  # of its own: a DHT MAC is no other MAC
        self._nonces = TimedStorage()  # nonces seen within the clock window (older requests are refused anyway)

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key) -> None:
        request.auth.time = get_dht_time()
        request.auth.nonce = secrets.token_bytes(NONCE_BYTES)
        request.auth.signature = _mac(self.key, REQUEST, request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        if len(auth.nonce) != NONCE_BYTES or not hmac.compare_digest(auth.signature, _mac(self.key, REQUEST, request)):
            return False
        now = get_dht_time()
        if abs(auth.time - now) > CLOCK_WINDOW_S:
            return False
        if auth.nonce in self._nonces:
            return False
        self._nonces.store(auth.nonce, None, now + 2 * CLOCK_WINDOW_S)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = _mac(self.key, RESPONSE, response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        return auth.nonce == request.auth.nonce and hmac.compare_digest(auth.signature,
                                                                        _mac(self.key, RESPONSE, response))
