"""Restart strategies: how often and how soon a failed job is tried again (Flink's three).

Every driver fails a job over the same way (``deploy.driver.Driver.run``): roll back to the
latest completed epoch and run again. The strategy only decides *whether* to try again and
*after how long*, from the times of the failures so far. The decision is a pure function
(``RestartStrategy.decide``), so the simulator can apply it to virtual time; the driver runs
the retry loop with tenacity, which calls ``decide`` through a stop and a wait condition.

- ``FixedDelayRestart(attempts, delay)``: Flink's ``fixed-delay``: up to ``attempts``
  restarts, ``delay`` seconds apart.
- ``ExponentialDelayRestart(initial, max_delay, multiplier, jitter, reset_after, attempts)``:
  Flink's ``exponential-delay``: the delay starts at ``initial`` and is multiplied after every
  failure up to ``max_delay``; a job that ran ``reset_after`` seconds without failing starts
  again at ``initial``. ``jitter`` spreads delays by +-that fraction, drawn from a hash of the
  failure count (no hidden random state: the same failures give the same delays).
- ``FailureRateRestart(max_failures, interval, delay)``: Flink's ``failure-rate``: restart
  after ``delay`` unless more than ``max_failures`` failures fell within the last
  ``interval`` seconds.

>>> s = FixedDelayRestart(attempts=2, delay=0.5)
>>> s.decide([1.0], 1.0), s.decide([1.0, 2.0], 2.0), s.decide([1.0, 2.0, 3.0], 3.0)
(0.5, 0.5, None)
>>> e = ExponentialDelayRestart(initial=1.0, max_delay=5.0, multiplier=2.0, jitter=0.0, reset_after=60.0)
>>> [e.decide([0.0] * n, 0.0) for n in range(1, 6)]
[1.0, 2.0, 4.0, 5.0, 5.0]
>>> e.decide([0.0, 100.0], 100.0)      # 100 s of stable running since the last failure: reset
1.0
>>> r = FailureRateRestart(max_failures=2, interval=10.0, delay=0.0)
>>> r.decide([0.0, 1.0], 1.0), r.decide([0.0, 1.0, 2.0], 2.0), r.decide([0.0, 1.0, 20.0], 20.0)
(0.0, None, 0.0)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


class RestartStrategy:
    """Base: ``decide(failures, now)`` returns the delay before the next attempt, or None to
    give up. ``failures`` are the times (seconds on the driver's clock) of every failure so
    far, the newest last and equal to ``now``."""

    def decide(self, failures: list[float], now: float) -> float | None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class FixedDelayRestart(RestartStrategy):
    """Up to ``attempts`` restarts, ``delay`` seconds apart (``restart-strategy.fixed-delay.*``)."""

    attempts: int = 10
    delay: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.delay < 0:
            raise ValueError(f"fixed-delay restart: attempts and delay must be >= 0, got {self.attempts}, {self.delay}")

    def decide(self, failures: list[float], now: float) -> float | None:
        return self.delay if len(failures) <= self.attempts else None

    def describe(self) -> str:
        return f"fixed-delay: gave up after {self.attempts} restarts"


@dataclass(frozen=True)
class ExponentialDelayRestart(RestartStrategy):
    """Delays ``initial * multiplier**k`` capped at ``max_delay``, where k counts the failures
    since the job last ran ``reset_after`` seconds without one (``exponential-delay.*``).
    ``attempts`` (None: unlimited) bounds the restarts since that reset."""

    initial: float = 1.0
    max_delay: float = 300.0
    multiplier: float = 2.0
    jitter: float = 0.1
    reset_after: float = 3600.0
    attempts: int | None = None

    def __post_init__(self) -> None:
        if self.initial < 0 or self.max_delay < self.initial or self.multiplier < 1:
            raise ValueError("exponential-delay restart: need 0 <= initial <= max_delay and multiplier >= 1")
        if not 0 <= self.jitter < 1 or self.reset_after <= 0:
            raise ValueError("exponential-delay restart: need 0 <= jitter < 1 and reset_after > 0")
        if self.attempts is not None and self.attempts < 0:
            raise ValueError(f"exponential-delay restart: attempts must be >= 0 or None, got {self.attempts}")

    def decide(self, failures: list[float], now: float) -> float | None:
        streak = 1
        for prev, cur in zip(reversed(failures[:-1]), reversed(failures[1:]), strict=True):
            if cur - prev >= self.reset_after:
                break
            streak += 1
        if self.attempts is not None and streak > self.attempts:
            return None
        delay = min(self.initial * self.multiplier ** (streak - 1), self.max_delay)
        if self.jitter:
            h = hashlib.blake2b(f"{len(failures)}".encode(), digest_size=2).digest()
            delay *= 1 + self.jitter * (int.from_bytes(h, "little") / 32767.5 - 1)
        return delay

    def describe(self) -> str:
        return (f"exponential-delay: gave up after {self.attempts} restarts "
                f"without {self.reset_after}s of stable running")


@dataclass(frozen=True)
class FailureRateRestart(RestartStrategy):
    """Restart after ``delay`` unless more than ``max_failures`` failures fell within the last
    ``interval`` seconds (``restart-strategy.failure-rate.*``)."""

    max_failures: int = 3
    interval: float = 300.0
    delay: float = 1.0

    def __post_init__(self) -> None:
        if self.max_failures < 0 or self.interval <= 0 or self.delay < 0:
            raise ValueError("failure-rate restart: need max_failures >= 0, interval > 0 and delay >= 0")

    def decide(self, failures: list[float], now: float) -> float | None:
        recent = sum(1 for t in failures if now - t <= self.interval)
        return self.delay if recent <= self.max_failures else None

    def describe(self) -> str:
        return f"failure-rate: more than {self.max_failures} failures within {self.interval}s"


def no_restart() -> FixedDelayRestart:
    """Fail at the first failure (Flink's ``restart-strategy: none``)."""
    return FixedDelayRestart(attempts=0, delay=0.0)


def parse_restart_strategy(spec: str) -> RestartStrategy:
    """A strategy from a CLI string, Flink-style:

    ``none`` | ``fixed-delay:ATTEMPTS:DELAY`` | ``exponential-delay:INITIAL:MAX[:MULTIPLIER[:ATTEMPTS]]``
    | ``failure-rate:MAX_FAILURES:INTERVAL:DELAY``

    >>> parse_restart_strategy("fixed-delay:3:0.2")
    FixedDelayRestart(attempts=3, delay=0.2)
    >>> parse_restart_strategy("failure-rate:5:60:1").max_failures
    5
    """
    name, *args = spec.split(":")
    try:
        if name == "none" and not args:
            return no_restart()
        if name == "fixed-delay" and len(args) == 2:
            return FixedDelayRestart(int(args[0]), float(args[1]))
        if name == "exponential-delay" and 2 <= len(args) <= 4:
            mult = float(args[2]) if len(args) > 2 else 2.0
            attempts = int(args[3]) if len(args) > 3 else None
            return ExponentialDelayRestart(float(args[0]), float(args[1]), mult, attempts=attempts)
        if name == "failure-rate" and len(args) == 3:
            return FailureRateRestart(int(args[0]), float(args[1]), float(args[2]))
    except ValueError as exc:
        raise ValueError(f"restart strategy {spec!r}: {exc}") from None
    raise ValueError(
        f"restart strategy {spec!r}: expected none, fixed-delay:ATTEMPTS:DELAY, "
        f"exponential-delay:INITIAL:MAX[:MULTIPLIER[:ATTEMPTS]] or failure-rate:MAX_FAILURES:INTERVAL:DELAY"
    )
