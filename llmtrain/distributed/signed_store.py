"""Signed control keys: the values llmtrain keeps in a store that other processes act on
(evictions, failures, plans, fences, the watchdog's verdicts) carry an HMAC made with a
per-job secret, and are verified before anyone acts on them.

A TCPStore has no authentication: whoever reaches its port reads and writes every key.
Without signatures, a stranger on the network could have an agent SIGKILL a healthy worker
(``evict/<holder>``), abort every NCCL rank's communicators (a generation's ``failed``),
refuse every checkpoint write (``fence/token``) or hand survivors a plan of its own. With
them, a value written by a client without the secret changes nothing: it is reported once
as a ``control_key_forged`` event naming the key, and read as if it were not there.

**The secret** is the job's, the same in every launcher and worker: ``LLMTRAIN_JOB_SECRET``
(at least 16 characters) or ``LLMTRAIN_JOB_SECRET_FILE`` (a file holding it), given by the
scheduler's job script; a single-node ``llmtrain launch`` makes one for its own workers when
none is given. It is never logged, never written to the run dir or the store.

**What a signature covers**: the job (``LLMTRAIN_RDZV_ID``), the key's full name (the
namespace it lives in included) and the value, so a genuine value cannot be replayed under
another key, generation, round or job. A value replayed under its own key is one that key
already held; values whose repetition would matter carry their own count (an eviction's).

**What stays unsigned**: counters a server increments (``add``) cannot carry a signature;
llmtrain uses them as wake-ups and tallies, and reads the signed value behind each before
acting. The empty value means "absent" (``compare_set``'s expected value for a new key) and
is stored as it is. Process groups' own keys (gloo's and NCCL's addresses) and torchrun's
rendezvous state are not llmtrain's: ``raw`` is the unsigned store beneath, for them.
``docs/cluster.md`` says what they still allow and how to keep the store's port private.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from llmtrain.config import ConfigError

if TYPE_CHECKING:  # the launcher's CLI imports this before it needs torch
    import torch.distributed as dist

log = logging.getLogger(__name__)

SECRET_ENV = "LLMTRAIN_JOB_SECRET"
SECRET_FILE_ENV = "LLMTRAIN_JOB_SECRET_FILE"
MIN_SECRET_CHARS = 16
_SEP = b" "


class Forged(ValueError):
    """A value at ``key`` that no holder of the job's secret wrote."""

    def __init__(self, key: str, raw: bytes, why: str):
        super().__init__(f"the store's value at {key!r} is not signed with the job's "
                         f"secret ({why}): ignored")
        self.key, self.raw, self.why = key, raw, why


class ForgedSink(Protocol):
    def emit(self, event: str, **fields: object) -> None: ...


_sink: ForgedSink | None = None
_reported: set[str] = set()
_lock = threading.Lock()


def report_forged_to(events: ForgedSink | None) -> None:
    """Where this process reports forged values (its event log) from now on, each key
    once; without one they are logged only."""
    global _sink
    with _lock:
        _sink = events
        _reported.clear()


def _report(error: Forged) -> None:
    """Once a key and process: a poller that meets the same forged value every tick says
    so once."""
    with _lock:
        if error.key in _reported:
            return
        _reported.add(error.key)
    log.warning("%s", error)
    if _sink is not None:
        _sink.emit("control_key_forged", key=error.key, why=error.why)


def job_secret(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The job's secret from ``LLMTRAIN_JOB_SECRET`` or ``LLMTRAIN_JOB_SECRET_FILE``;
    None when neither is set. ConfigError for one too short, or a file that cannot be
    read."""
    text = env.get(SECRET_ENV)
    where = SECRET_ENV
    if not text and env.get(SECRET_FILE_ENV):
        where = f"{SECRET_FILE_ENV}={env[SECRET_FILE_ENV]}"
        try:
            with open(env[SECRET_FILE_ENV], encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read the job's secret ({e.strerror}); give "
                              f"every node of the job a readable copy") from None
    if not text:
        return None
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(f"{where}: the job's secret has {len(text)} characters, fewer "
                          f"than {MIN_SECRET_CHARS}; make one with `openssl rand -hex 32`")
    return text.encode()


def new_secret() -> str:
    """A fresh secret for a job whose launcher is its only one."""
    return secrets.token_hex(32)


def require_secret(env: Mapping[str, str] = os.environ) -> bytes:
    """The job's secret; ConfigError naming what to set when there is none."""
    secret = job_secret(env)
    if secret is None:
        raise ConfigError(
            f"the rendezvous store outside the workers is in use but no job secret is "
            f"given, so control keys cannot be signed: set {SECRET_ENV} (or "
            f"{SECRET_FILE_ENV}) to the same value on every node, e.g. "
            f"`export {SECRET_ENV}=$(openssl rand -hex 32)` in the job script")
    return secret


def _notes_broken(method: Callable) -> Callable:
    """Marks the store view broken when ``method`` meets a closed connection, so that the
    next request connects again (see :class:`SignedStore`)."""
    @functools.wraps(method)
    def call(self: SignedStore, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as e:
            import torch.distributed as dist
            if isinstance(e, dist.DistNetworkError):
                self._broken = True
            raise
    return call


def _retried(method: Callable) -> Callable:
    """For a request that may be made twice to the same effect (not ``add`` nor
    ``append``, whose effect a broken connection leaves unknown): one that meets a closed
    connection connects again at once and is made once more."""
    @functools.wraps(method)
    def call(self: SignedStore, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as e:
            import torch.distributed as dist
            if not isinstance(e, dist.DistNetworkError) or self._reconnect is None:
                raise
        return method(self, *args, **kwargs)  # through ``raw``, connected again
    return call


class SignedStore:
    """A store client whose ``set``, ``get``, ``compare_set`` and ``append`` values are
    signed and verified (``genuine_values`` reads several); ``add``, ``check``, ``wait`` and
    ``delete_key`` pass through (see the module's docstring).

    ``context`` names where the keys live (the job and the namespace): it is part of every
    signature. ``get`` raises :class:`Forged` (reported once) for a value that fails its
    check; :meth:`genuine` reads one as absent instead. With no ``secret`` (a plain torchrun
    job's own store, which torchrun does not authenticate either) values are stored as they
    are and nothing is verified: :func:`job_store_view`.
    """

    def __init__(self, store: dist.Store, secret: bytes | None, context: str,
                 reconnect: Callable[[], dist.Store] | None = None):
        """``reconnect``: how to open the same store view anew. A TCPStore client whose
        server restarted fails every request for good; with it, a request that meets a
        broken connection connects again: at once, and is made again, where making it
        twice does no harm; else at the next request (connecting raises what it raises
        while the store is still out)."""
        self._raw, self.context, self._reconnect = store, context, reconnect
        self._key = secret
        self._broken = False

    @property
    def raw(self) -> dist.Store:
        """The unsigned store beneath, connected again if the last request broke."""
        if self._broken and self._reconnect is not None:
            self._raw, self._broken = self._reconnect(), False
        return self._raw

    @property
    def underlying_store(self) -> dist.Store:
        """The connection beneath (a PrefixStore's, or the store itself)."""
        return getattr(self.raw, "underlying_store", self.raw)

    # -- the signature ------------------------------------------------------------------
    def _mac(self, key: str, value: bytes) -> bytes:
        message = b"\0".join((self.context.encode(), key.encode(), value))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        """``value`` as stored at ``key``: its signature and its bytes (base64, one line);
        the empty value stays empty."""
        value = value.encode() if isinstance(value, str) else value
        if not value or self._key is None:
            return value
        return self._mac(key, value) + _SEP + base64.b64encode(value) + b"\n"

    def open(self, key: str, raw: bytes) -> bytes:
        """The value ``raw`` holds at ``key``; Forged (reported) unless it is one record
        signed for that key."""
        values = self._records(key, raw, strict=True)
        return values[0] if values else b""

    def _records(self, key: str, raw: bytes, strict: bool) -> list[bytes]:
        if self._key is None:
            return [raw] if strict else list(filter(None, raw.splitlines()))
        values = []
        for line in filter(None, raw.splitlines()):
            mac, _, body = line.partition(_SEP)
            try:
                value = base64.b64decode(body, validate=True)
            except ValueError:
                value = None
            if value is None or not hmac.compare_digest(mac, self._mac(key, value)):
                error = Forged(key, raw, "unsigned" if value is None else "bad signature")
                _report(error)
                if strict:
                    raise error
                continue
            values.append(value)
        if strict and len(values) > 1:
            error = Forged(key, raw, "several records where one was written")
            _report(error)
            raise error
        return values

    # -- the store's interface ----------------------------------------------------------
    @_retried
    @_notes_broken
    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self._fetch(key))

    @_retried
    @_notes_broken
    def _fetch(self, key: str) -> bytes:
        return self.raw.get(key)

    @_notes_broken
    def genuine(self, key: str) -> bytes | None:
        """The value at ``key`` if it exists and is signed; None when absent or forged
        (reported)."""
        if not self.check([key]):
            return None
        try:
            return self.get(key) or None
        except Forged:
            return None

    def wait_genuine(self, key: str, timeout: timedelta) -> bytes | None:
        """The value at ``key`` once a signed one stands there, or None after ``timeout``.
        It waits in the store (no polling) for the key to appear; past a forged value
        (reported), it looks every 50 ms until a genuine write replaces it. Under a
        millisecond left counts as none: c10d gets it as 0 ms, which a TCPStore takes as
        expired but a HashStore as no timeout at all (a test's warm generation, looking
        2 µs before its deadline, waited for ever)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while (left := deadline - time.monotonic()) >= 0.001:
            import torch.distributed as dist
            try:
                self.raw.wait([key], timedelta(seconds=left))
            except dist.DistStoreError as e:  # the wait's timeout; other errors propagate
                if "timeout" not in str(e).lower():
                    raise
                return None
            value = self.genuine(key)
            if value is not None:
                return value
            time.sleep(0.05)
        return None

    @_retried
    @_notes_broken
    def genuine_values(self, keys: Sequence[str]) -> list[bytes | None]:
        """``multi_get`` of keys that exist, a forged value (reported) read as None."""
        values: list[bytes | None] = []
        for k, raw in zip(keys, self.raw.multi_get(list(keys))):
            try:
                values.append(self.open(k, raw))
            except Forged:
                values.append(None)
        return values

    @_retried
    @_notes_broken
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Sets ``desired`` if ``key`` holds ``expected`` (empty: absent); returns what it
        holds after, verified. Forged (with ``raw``, for :meth:`replace`) when that is a
        value nobody with the secret wrote."""
        return self.open(key, self.raw.compare_set(key, self.seal(key, expected),
                                                   self.seal(key, desired)))

    @_retried
    @_notes_broken
    def replace(self, key: str, forged: bytes, desired: str | bytes) -> bytes:
        """Puts ``desired`` where a forged value ``forged`` stands, unless another write
        came first; returns what the key holds after, verified."""
        return self.open(key, self.raw.compare_set(key, forged, self.seal(key, desired)))

    @_notes_broken
    def claim(self, key: str, desired: str | bytes) -> bytes:
        """``compare_set(key, "", desired)``, where a forged value counts as absent."""
        try:
            return self.compare_set(key, "", desired)
        except Forged as e:
            return self.replace(key, e.raw, desired)

    @_notes_broken
    def append(self, key: str, value: str | bytes) -> None:
        """Appends one signed record, on a line of its own whatever a stranger appended
        before it; :meth:`records` reads them back."""
        self.raw.append(key, b"\n" + self.seal(key, value))

    @_notes_broken
    def records(self, key: str) -> list[bytes]:
        """The signed records appended at ``key``, in order; forged ones are dropped and
        reported."""
        return self._records(key, self._fetch(key), strict=False)

    @_notes_broken
    def add(self, key: str, amount: int) -> int:
        return self.raw.add(key, amount)

    @_retried
    @_notes_broken
    def check(self, keys: list[str]) -> bool:
        return self.raw.check(keys)

    @_retried
    @_notes_broken
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.raw.wait(keys)
        else:
            self.raw.wait(keys, timeout)

    @_retried
    @_notes_broken
    def delete_key(self, key: str) -> bool:
        return self.raw.delete_key(key)


def signed(store: dist.Store, context: str, env: Mapping[str, str] = os.environ,
           reconnect: Callable[[], dist.Store] | None = None) -> SignedStore:
    """``store`` with signed values under the job's secret (ConfigError without one);
    ``context``: where its keys live, naming the job; ``reconnect``: see
    :class:`SignedStore`."""
    return SignedStore(store, require_secret(env), context, reconnect)


def job_store_view(store: dist.Store, context: str, env: Mapping[str, str] = os.environ,
                   reconnect: Callable[[], dist.Store] | None = None) -> SignedStore:
    """``store`` signed with the job's secret when one is given, else as it is: for the
    job's own store (torchrun's, in its agent or rank 0), which a job launched without
    ``llmtrain launch`` has, and which torchrun itself trusts its network to keep."""
    return SignedStore(store, job_secret(env), context, reconnect)
