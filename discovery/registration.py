"""`Registration`: one leased etcd key kept registered for as long as its owner runs.

Usage (a worker shim; a router registers its RouterInfo the same way)::

    reg = Registration(
        discovery,
        key=lambda rid: subjects.worker_key(ns, rid),   # the id -> the etcd key
        value=make_info,                                # the id -> the msgspec Struct to store (JSON)
        ttl=10,
        ttl_setting="lease_ttl",    # the owner's setting `ttl` comes from (Discovery.grant); None: etcd's TTL
        name=None,                  # or a stable id (a subject token); the key is still leased
        on_lost=on_lost,            # async (old_id) -> None, awaited before registering anew
        on_registered=on_new,       # async (new_id) -> None, awaited after each re-registration
        on_failing=failed,          # (DiscoveryError, retry_s) -> None: a try to register anew failed
        on_answered=answered,       # (KeyTaken) -> None: a try etcd answered, the key still the lost lease's
        before_create=ready,        # async (id) -> None, awaited before the key is created
        claims=claim,               # (id) -> {key: Struct}: more keys under the same lease, each unique
    )
    my_id = await reg.start()       # registers once: KeyTaken if `name` is held, DiscoveryError if etcd is down
    reg.update()                    # value(id) changed (a field flipped): re-put it, in the background
    await reg.stop()                # revoke: the key disappears for every watcher at once (safe twice);
                                    # False when etcd did not revoke the lease (the key stays until its TTL)
    reg.revoke_now()                # the same, blocking for at most ~1 s, off the loop (an exit at once)

Identity: `reg.id` is the lease id in lowercase hex, or `name` when one is given. A named key is
created with a create-if-absent transaction, so a second holder of the same name fails loudly
(KeyTaken) instead of overwriting the first; the key's holder is checked before `before_create` too,
so a second owner never acts under a name a live one holds.

Claims: `claims(id)` names more keys created under the same lease, each with a create-if-absent
transaction before `before_create`: a key another lease holds fails the registration as a held name
does (KeyTaken naming the key, its holder and the holder's value). A shim claims its engine so
(worker_shim.engine_claim). They go with the lease, and are created again with each new one.

Loss: etcd's own answer (the lease expired or is unknown, e.g. the process stalled past its TTL or
someone revoked it), or the keep-alive loop failing on a defect (the lease revoked first; where etcd
did not revoke it, it is tried again as the lost lease is released, and by `stop()`). Then the
owner hears `on_lost(old_id)`, a new lease is granted and the key created again (a new id, or the
same `name`), retrying with backoff while etcd does not answer, and the owner hears
`on_registered(new_id)`; `reg.id` is the new id from then on. Each try etcd fails meanwhile is
told to `on_failing(error, seconds to the next try)` (a shim's episode: its log lines and /health);
without it the registration says the first at WARNING with what to do (discovery.advice), then at
most every SAID_EVERY_S with a count (until 2026-12-07 each try was a WARNING, every 5 s for as long
as a full etcd refused it, each a multi-line gRPC error). Each try etcd answers with the key still
held by the lost lease (its revoke failed: waited out, each failure a WARNING, an ERROR with its
traceback for an unexpected error) is told to `on_answered(KeyTaken)`: a shim's episode ends there
(until a review of 2026-12-07 its /health said "registering with etcd fails for N s" for as long as
the wait lasted, etcd answering all along).
If a named key was taken meanwhile (`failure` is KeyTaken, naming the holder), a setting was refused
(etcd's least TTL now above `ttl`, a write etcd denies the user, or one the owner's hook names:
`failure` is the ConfigError naming the setting), or an owner's hook raised, `failed` is set: the
owner must act (stop, or start over with a new Registration). So it is when a keep-alive check
finds the key or a claim held by another lease while ours lives: a live second owner of the name
(etcd deletes a key with its lease), which took it once it was deleted by hand. From etcd's answer
until the supervisor registers anew, `state` is "lost".

The supervisor is the registration for the life of the process: an unexpected error in one of its
ticks (a bug, a value() that raises) is an ERROR with its traceback (the first, then at most every
30 s with a count: runtime.TickErrors) and the next tick runs after a backoff; should the supervisor end
anyway, `failed` is set with a `failure` naming it (an audit of 2026-12-06 found one raise ended it
for good: a deleted key never put back, a lost lease never replaced, and `state` still "registered").
etcd merely not answering changes nothing (`state` is "unknown"): the key keeps its lease, and once
etcd answers again the value is put once more, so an `update()` made during the outage lands. A put
etcd fails (not answering, refusing a write) is tried again each round, said as one episode: the
first at WARNING with what to do, then at most every SAID_EVERY_S with a count, and its end at INFO;
`put_trouble` reads it meanwhile (an owner's health: a shim's /health).

`value(id)` is called for every put, so it always stores the owner's current state. An `update()`
made while the key is being created (by `start()`, or anew after a loss) is put once it is.

`before_create(id)` runs once the id is known (the lease granted) and before the key exists: what
the key announces must work by the time anyone reads it (a shim subscribes to its request subjects
there; otherwise a router could send a request in between and find no responder). If it raises,
the lease is released: `start()` raises it; during re-registration `failed` is set.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial

import msgspec

from discovery.advice import advice
from discovery.failed_tries import SAID_EVERY_S, FailedTries
from discovery.lease import Lease, LeaseState
from discovery.session import DEFAULT_TTL, Discovery, DiscoveryError, KeyTaken
from protocol import ConfigError, encode_json
from runtime import StopSteps, Throttle, TickErrors, background, cancel_and_wait

__all__ = ["PutTrouble", "Registration", "RegistrationState"]

log = logging.getLogger(__name__)
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0


class RegistrationState(enum.Enum):
    NEW = "new"
    REGISTERED = "registered"  # etcd renewed the lease on its last try
    UNKNOWN = "unknown"  # etcd does not answer; the key is presumed held
    LOST = "lost"  # etcd said the lease is gone, and the supervisor has not registered anew yet
    REREGISTERING = "reregistering"  # the lease was lost; registering anew
    FAILED = "failed"  # a named key was taken by someone else while re-registering
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class PutTrouble:
    """A re-put of the key that etcd keeps failing (Registration.put_trouble): the key stays, its
    value the last put that worked."""

    tries: int  # failed tries since the last put that worked
    failing_s: float  # since the first of them
    why: str  # the last one's error, with what to do (discovery.advice)


class _PutFailures(FailedTries):
    """The re-puts etcd failed since the last that worked (an episode): a WARNING as it starts, with
    what to do (discovery.advice), the count at most every SAID_EVERY_S while it lasts, an INFO as
    it ends. Until 2026-12-07 each failed try was a WARNING, one each keep-alive tick (TTL/3 s) for
    as long as etcd refused the put, naming neither what to do nor an end."""

    def failed(self, key: str, exc: DiscoveryError, retry_s: float) -> None:
        if not self.count(exc):
            return
        if self.tries == 1:
            log.warning("re-putting %s failed (%s): retrying each keep-alive check (every %.1fs), said again at "
                        "most every %.0fs while it fails and once it works",
                        key, self.why, retry_s, SAID_EVERY_S)  # fmt: skip
        else:
            log.warning("re-putting %s still fails after %.0fs (%d tries; the last: %s)",
                        key, self.lasted(), self.tries, self.why)  # fmt: skip

    def ended(self, key: str, until: str | None = None) -> None:
        """The episode under way, if any, ends: a put worked (`until` None), or `until` says what ended it."""
        if not self.tries:
            return
        if until is None:
            log.info("re-put %s after %.1fs of etcd failing it (%d tries)", key, self.lasted(), self.tries)
        else:
            log.info("re-putting %s failed for %.1fs (%d tries; the last: %s) until %s",
                     key, self.lasted(), self.tries, self.why, until)  # fmt: skip
        self.end()

    def trouble(self) -> PutTrouble | None:
        if not self.tries:
            return None
        return PutTrouble(self.tries, self.lasted(), self.why)


class Registration:
    """Owns one lease at a time and the key under it; its supervisor task re-puts and re-registers."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        key: Callable[[str], str],
        value: Callable[[str], msgspec.Struct],
        ttl: int = DEFAULT_TTL,
        ttl_setting: str | None = "lease_ttl",
        name: str | None = None,
        on_lost: Callable[[str], Awaitable[None]] | None = None,
        on_registered: Callable[[str], Awaitable[None]] | None = None,
        on_failing: Callable[[DiscoveryError, float], None] | None = None,
        on_answered: Callable[[KeyTaken], None] | None = None,
        before_create: Callable[[str], Awaitable[None]] | None = None,
        claims: Callable[[str], Mapping[str, msgspec.Struct]] | None = None,
    ) -> None:
        self._discovery = discovery
        self._key = key
        self._value = value
        self.ttl = ttl  # with ttl_setting None, the TTL etcd granted once it did (Discovery.grant)
        self._ttl_setting = ttl_setting
        self.name = name
        self._on_lost = on_lost
        self._on_registered = on_registered
        self._on_failing = on_failing
        self._on_answered = on_answered
        self._before_create = before_create
        self._claims = claims
        self.id = ""
        self.lease: Lease | None = None
        self.registrations = 0
        # whether stop() revoked the lease, set before it raises a cancellation that came meanwhile;
        # None until then, or where that cancellation cut the revoke itself
        self.revoked: bool | None = None
        self.failed = asyncio.Event()
        self.failure: DiscoveryError | ConfigError | None = None
        self._phase = RegistrationState.NEW
        self._dirty = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._outages = 0  # the lease's outages the supervisor has seen end (a new lease's start at 0)
        self._tick_errors = TickErrors(log, "the registration's supervisor")
        self._failing = Throttle(SAID_EVERY_S)  # the tries to register anew that etcd failed
        self._put_failures = _PutFailures(every_s=SAID_EVERY_S)  # read now: tests set it

    @property
    def state(self) -> RegistrationState:
        lease = self.lease
        if self._phase is RegistrationState.REGISTERED and lease is not None:
            if lease.state is LeaseState.UNKNOWN:
                return RegistrationState.UNKNOWN
            if lease.lost.is_set():
                return RegistrationState.LOST
        return self._phase

    @property
    def unrenewed_s(self) -> float | None:
        """Seconds since etcd last renewed the lease while it does not answer (state "unknown");
        None otherwise."""
        lease = self.lease
        return lease.unrenewed_s if self.state is RegistrationState.UNKNOWN and lease is not None else None

    @property
    def put_trouble(self) -> PutTrouble | None:
        """The re-put etcd keeps failing (an update() or the put after an outage); None while the
        last put worked. Until 2026-12-07 only the log said it: an owner's health read nothing."""
        return self._put_failures.trouble()

    @property
    def key(self) -> str:
        return self._key(self.id)

    async def start(self) -> str:
        """Register once and start supervising; returns the id."""
        if self._task is None:
            await self._register()
            self._task = background(
                self._supervise(),
                f"registration-{self.id}",
                "the key is no longer kept registered (put back, re-put, registered anew): the registration failed",
                self._supervisor_crashed,
            )
        return self.id

    def update(self) -> None:
        """Put value(id) again soon (retried until etcd takes it)."""
        self._dirty = True
        self._wake.set()

    async def stop(self) -> bool:
        """Stop supervising and revoke the lease; whether it is gone (none held counts): False when etcd
        did not revoke it (a WARNING says why), its keys then kept until its TTL passes. Cancelled while
        the supervisor ends, it revokes still and raises after: `revoked` says how the revoke went."""
        task, self._task = self._task, None
        self.revoked = None
        steps = StopSteps()  # cancelled while the supervisor ends, the lease is revoked still
        if task is not None:
            with steps:
                # a crash of it was said as it came (and failed the registration): the lease goes anyway
                await cancel_and_wait(task)
        if self._put_failures.tries:  # only then: before start() there is no id to make a key of
            self._put_failures.ended(self.key, "the registration stopped")
        # kept while it is revoked: a second SIGTERM's revoke_now() revokes it still, should etcd be
        # slow (until a review of 2026-12-08 it found none, and neither did nor said anything)
        lease = self.lease
        try:
            self.revoked = lease is None or await self._discovery.release(lease)
        finally:
            self.lease = None
        self._phase = RegistrationState.STOPPED
        steps.end()
        return self.revoked

    def revoke_now(self, timeout: float = 1.0) -> None:
        """Revoke the lease without the event loop, within about `timeout` (Lease.revoke_now): for a
        process exiting at once, whose stop() will not run or not end (its revoke under way)."""
        if self.lease is not None:
            self.lease.revoke_now(timeout)

    # --- internals ------------------------------------------------------------------------------

    async def _register(self) -> None:
        lease = await self._discovery.grant(self.ttl, setting=self._ttl_setting)
        if lease.ttl != self.ttl:  # raised to etcd's least (ttl_setting None): asked for from then on, said once
            log.info(
                "lease %s: etcd granted %d s where %d s was asked (it grants no TTL under 1.5 x its "
                "--election-timeout, rounded up); %d s it is",
                lease.hex_id,
                lease.ttl,
                self.ttl,
                lease.ttl,
            )
            self.ttl = lease.ttl
        rid = self.name or lease.hex_id
        try:
            if self.name is not None:
                # A name held by a live owner: fail before before_create, which subscribes to the
                # name's subjects and publishes under it (create() alone would say so only after).
                holder = await self._discovery.holder(self._key(rid))
                if holder is not None and holder != lease.id:
                    raise KeyTaken(self._key(rid), holder)
            for key, claim in self._claimed(rid).items():
                await self._discovery.create(key, encode_json(claim), lease)
            if self._before_create is not None:
                await self._before_create(rid)
            await self._discovery.create(self._key(rid), encode_json(self._value(rid)), lease)
        except BaseException:
            await self._discovery.release(lease)
            raise
        self.lease, self.id = lease, rid
        self.registrations += 1
        self._phase = RegistrationState.REGISTERED
        log.info("registered %s under lease %s", self._key(rid), lease.hex_id)

    def _claimed(self, rid: str) -> Mapping[str, msgspec.Struct]:
        return self._claims(rid) if self._claims is not None else {}

    def _supervisor_crashed(self) -> None:
        """The supervisor crashed (background() said it), though it runs until stop() cancels it:
        fail, so the owner acts. (It returns only once the registration failed, and said why.)"""
        if self.failed.is_set():
            return
        self._fail(DiscoveryError(f"the registration's supervisor of {self.key} crashed"))

    async def _supervise(self) -> None:
        retry = RETRY_MIN_S
        while True:
            try:
                if not await self._tick():
                    return
                retry = RETRY_MIN_S
            except Exception as exc:
                self._tick_errors.what = f"keeping {self.key} registered"  # the key changes with a new lease
                self._tick_errors(exc)
                # A tick that fails at once each time (a lost lease wakes it straightaway) must not spin.
                await asyncio.sleep(retry)
                retry = min(retry * 2, RETRY_MAX_S)

    async def _tick(self) -> bool:
        """One round: wait for the lease's loss, an update() or the next check, then act. False once
        the registration failed."""
        lease = self.lease
        assert lease is not None
        lost = asyncio.create_task(lease.lost.wait())
        woken = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait({lost, woken}, timeout=self._tick_s(lease), return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            woken.cancel()
        self._wake.clear()
        if lease.lost.is_set():
            if not await self._reregister(lease):
                return False
            self._outages = 0
            return True
        if lease.outages != self._outages and lease.state is LeaseState.ALIVE:
            self._outages = lease.outages  # etcd is back: make sure the key holds the current value
            self._dirty = True
        if self._dirty:
            await self._put()
        elif lease.state is LeaseState.ALIVE:
            await self._check_key(lease)
        return not self.failed.is_set()

    @staticmethod
    def _tick_s(lease: Lease) -> float:
        """The longest wait between two rounds (a keep-alive check, a failed put tried again)."""
        return max(lease.ttl / 3.0, 0.2)

    async def _put(self) -> None:
        """Put the value anew, only while our lease holds the key (Discovery.rewrite): a plain put
        overwrote a live second owner's key (the same name twice, which took it after a delete by
        hand) when an update() or etcd's return came before the check that fails this owner, and
        that owner's check then failed the one holding the key (review of 2026-12-07). Another lease
        holding it fails this registration, as the check does; the key gone or held by no lease is
        put back as the check puts it."""
        lease = self.lease
        assert lease is not None
        # Cleared first, so an update() made during the put is put next; set again unless the put
        # succeeds: a value() or a put that raises (the supervisor's ERROR) must not lose the update.
        self._dirty = False
        put = False
        try:
            put = await self._discovery.rewrite(self.key, encode_json(self._value(self.id)), lease)
            if not put:
                put = await self._check_key(lease)
        except KeyTaken as exc:
            self._taken(exc, f"{self.key} is no longer held by its owner's lease {lease.hex_id}")
        except DiscoveryError as exc:
            self._put_failures.failed(self.key, exc, self._tick_s(lease))
        else:
            if put:
                self._put_failures.ended(self.key)
        finally:
            self._dirty = self._dirty or not put

    async def _check_key(self, lease: Lease) -> bool:
        """Put the key (and each claim) back when someone deleted it while its lease lives (an
        operator's `etcdctl del`, a broad prefix delete): nothing else would, and routers would pass
        this live owner over for good (a claim gone lets a second owner in). Put it back under our
        lease when no lease holds it (an `etcdctl put` of the same value): the key would outlive
        this owner, a dead worker listed for good (DESIGN.md: "a worker exists exactly as long as
        its lease"); only while none does (Discovery.reclaim), so an owner's create in between
        stands. Another lease holding it is a live second owner (etcd deletes a key with its lease),
        as when registering: the registration fails with KeyTaken, never puts it back (until
        2026-12-07 both owners put it back under their own lease every tick, for good). A read
        each keep-alive tick rather than a watch of the key: a watch can go quiet (cancelled,
        resumed past changes) where a read cannot, and one key's read costs etcd about what the
        keep-alive does. Whether the key and each claim are the lease's now (False: etcd did not
        answer, or the registration failed)."""
        for key, value in {self.key: self._value(self.id), **self._claimed(self.id)}.items():
            try:
                held = await self._discovery.holder(key)
                if held == lease.id:
                    continue
                if held:
                    raise KeyTaken(key, held)
                # Absent or put by hand alike (reclaim compares a missing key's lease as 0): a create
                # failed the owner as a rival's name when an `etcdctl put` came between the read and it.
                await self._discovery.reclaim(key, encode_json(value), lease)
            except KeyTaken as exc:
                self._taken(exc, f"{key} is no longer held by its owner's lease {lease.hex_id}")
                return False
            except DiscoveryError:
                return False  # etcd not answering (the lease says so), or the lease just went: its loss handles it
            if held is None:
                log.warning("%s was deleted while its lease %s lives (by someone else): put it back", key, lease.hex_id)
            else:
                log.error(
                    "%s was held by no lease (a put by hand), not by its owner's lease %s: it would outlive "
                    "this owner; put it back under %s",
                    key,
                    lease.hex_id,
                    lease.hex_id,
                )
        return True

    async def _reregister(self, lost: Lease) -> bool:
        old = self.id
        self._phase = RegistrationState.REREGISTERING
        self._failing.forget(None)  # a loss's first failing try is said at once
        self._put_failures.ended(self._key(old), "the lease was lost: registering anew puts the current value")
        log.warning("lease %s of %s lost (%s): registering anew", lost.hex_id, self._key(old), lost.lost_reason)
        await self._discovery.release(lost)
        if self._on_lost is not None and not await self._tell(self._on_lost, old):
            return False
        retry = RETRY_MIN_S
        while True:
            # Cleared before value() is read for the create: an update() made while it is in flight
            # (a shim's fingerprint found) is put by the next tick. Cleared after, it was lost for
            # good, the key keeping the old value (review of 2026-12-07).
            self._dirty = False
            try:
                await self._register()
                break
            except KeyTaken as exc:
                if exc.holder != lost.id:
                    self._taken(exc, f"cannot register {exc.key} again")
                    return False
                # Our own old lease, which etcd did not revoke (its keep-alive failed on a defect and
                # the revoke with it): its keys go with its TTL, so wait, as for etcd not answering.
                log.warning("registering %s again waits for %s, its own lost lease, to expire; retrying in %.1fs",
                            exc.key, lost.hex_id, retry)  # fmt: skip
                if (answered := self._on_answered) is not None and not self._told(partial(answered, exc), old):
                    return False
                await asyncio.sleep(retry)
                retry = min(retry * 2, RETRY_MAX_S)
            except DiscoveryError as exc:
                if not self._retry_failed(old, exc, retry):
                    return False
                await asyncio.sleep(retry)
                retry = min(retry * 2, RETRY_MAX_S)
            # A setting no retry mends: etcd's least TTL risen above ttl (Discovery.grant), etcd denying
            # the user a write (Discovery.create), or one the owner's before_create names (a shim's
            # --worker-name that NATS refuses).
            except ConfigError as exc:
                self._config_failed(old, exc)
                return False
            except Exception as exc:  # the owner's before_create
                self._hook_failed(old, exc)
                return False
        if self._on_registered is not None:
            return await self._tell(self._on_registered, self.id)
        return True

    def _retry_failed(self, old: str, exc: DiscoveryError, retry_s: float) -> bool:
        """A try to register anew that etcd failed: told to the owner's on_failing, else said here.
        False where that hook raised (the registration failed)."""
        if (failing := self._on_failing) is not None:
            return self._told(partial(failing, exc, retry_s), old)
        if (said := self._failing(None)) is None:
            return True
        held, ago = said
        more = f"; {held} more tries failed in {ago:.0f}s" if held else ""
        hint = f": {what}" if (what := advice(exc)) else ""
        log.warning("registering %s again failed (%s%s)%s; retrying at most %gs apart, said again at most every %.0fs",
                    self._key(old), exc, more, hint, RETRY_MAX_S, SAID_EVERY_S)  # fmt: skip
        return True

    def _taken(self, exc: KeyTaken, what: str) -> None:
        """Another live lease holds our key or a claim: a second owner (the same name twice), which
        only an operator can settle. Fail, so this owner acts (a shim exits naming --worker-name)."""
        log.error("%s: %s; is another process using the same name?", what, exc)
        self._fail(exc)

    async def _tell(self, hook: Callable[[str], Awaitable[None]], rid: str) -> bool:
        """Run an owner's hook; one that raises fails the registration (the owner must act)."""
        try:
            await hook(rid)
        except Exception as exc:
            self._hook_failed(rid, exc)
            return False
        return True

    def _told(self, hook: Callable[[], None], rid: str) -> bool:
        """Run an owner's synchronous hook as `_tell` runs one: one that raises fails the registration
        (raised inside an except clause, it went past this one's and ended the round, and each round
        after lost the lease anew, telling on_lost again)."""
        try:
            hook()
        except Exception as exc:
            self._hook_failed(rid, exc)
            return False
        return True

    def _config_failed(self, rid: str, exc: ConfigError) -> None:
        """A setting no retry mends (etcd's or the owner's hook's ConfigError): until a review of
        2026-12-08 one etcd refused was blamed on the owner's hook."""
        log.error("registering %s again failed: %s", self._key(rid), exc)
        self._fail(exc)

    def _hook_failed(self, rid: str, exc: Exception) -> None:
        log.error("the owner's hook for %s failed", self._key(rid), exc_info=exc)
        self._fail(DiscoveryError(f"the owner's hook failed: {exc!r}"))

    def _fail(self, failure: DiscoveryError | ConfigError) -> None:
        """Failed for good, with `failure` (said by the caller): the owner acts."""
        self.failure = failure
        self._phase = RegistrationState.FAILED
        self.failed.set()
