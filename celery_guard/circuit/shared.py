"""The memory a worker's processes share for backpressure: store-call counts and the state.

Prefork children make the store calls, but the main process owns consumption, so the counts
must reach it. The block is an anonymous shared mapping (``mmap(-1, ...)``: ``MAP_SHARED |
MAP_ANONYMOUS``) created in the main process at ``worker_init``, before the pool forks, so every
child inherits the same physical pages: the first ones, and the replacements the pool forks
later from the main process. Nothing to name, open or clean up, no file descriptor to pass, no
manager process; it disappears with the last process that maps it.

Why no lock: a lock shared across processes (``multiprocessing.Lock``, a futex in shared
memory) is held forever by a child SIGKILLed inside it (the OOM killer, a poison pill, a hard
time limit), and every other process would then hang on its next store call. Instead:

* each process writes only its own slot (slot 0 for the main process, 1 + the prefork child's
  index for a child, which a replacement child inherits and keeps counting in), with a thread
  lock private to that process for its own threads (dies with it, never shared);
* every field is an aligned 64-bit word, which x86-64 and arm64 load and store whole, so a reader
  never sees a torn value; a word only grows, so the main process works with differences of
  samples, and a value read a moment late is counted at the next sample;
* the reader cannot read a slot's fields as one snapshot: a writer bumps ``calls`` before
  ``failures``/``timeouts`` and the reader reads them in the other order, and the ratios are
  clamped to 1 anyway. The price is a window that may lag one sample (a fraction of a second).
* More prefork children than slots (a pool grown past :data:`SLOTS` - 1) share slots; their
  read-modify-writes may then lose an increment now and then. Counts, not money.

The header carries what the main process publishes to the children: the circuit's state (read
before every claim) and the count of openings.
"""

from __future__ import annotations

import mmap

from celery_guard.circuit.breaker import CircuitState, Totals

#: Per-process slots (slot 0: the main process).
SLOTS = 256

_HEADER_WORDS = 8
_STATE = 1
_OPEN = int(CircuitState.OPEN)
_OPENED = 2
_CONCURRENCY = 3

_SLOT_WORDS = 4
_CALLS = 0
_FAILURES = 1
_TIMEOUTS = 2
_LATENCY_MICROS = 3

_MAGIC = 0x63675F6369726375  # "cg_circu"


class SharedBlock:
    """Fixed-size, lock-free counters in an anonymous ``MAP_SHARED`` mapping (8 KB)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        words = _HEADER_WORDS + slots * _SLOT_WORDS
        self._map = mmap.mmap(-1, words * 8)  # anonymous; MAP_SHARED is the default
        self._words = memoryview(self._map).cast("Q")
        self._words[0] = _MAGIC

    # -- what the main process publishes ---------------------------------------------------------

    @property
    def state(self) -> CircuitState:
        value = self._words[_STATE]
        return CircuitState(value) if value in (0, 1, 2) else CircuitState.CLOSED

    @state.setter
    def state(self, state: CircuitState) -> None:
        self._words[_STATE] = int(state)

    @property
    def is_open(self) -> bool:
        """Whether the state is OPEN: :attr:`state` without building the enum (every delivery
        asks)."""
        return bool(self._words[_STATE] == _OPEN)

    @property
    def opened(self) -> int:
        return int(self._words[_OPENED])

    @opened.setter
    def opened(self, count: int) -> None:
        self._words[_OPENED] = count

    @property
    def concurrency(self) -> int | None:
        return int(self._words[_CONCURRENCY]) or None

    @concurrency.setter
    def concurrency(self, processes: int) -> None:
        self._words[_CONCURRENCY] = max(0, processes)

    # -- what every process counts ---------------------------------------------------------------

    def slot_for(self, index: int) -> int:
        """The slot of process ``index`` (0: main process; prefork children from 1)."""
        return index if index < self.slots else 1 + (index - 1) % (self.slots - 1)

    def add(self, slot: int, *, failed: bool, timed_out: bool, seconds: float) -> None:
        """Count one store call in ``slot``. One writer per slot (see the module docstring)."""
        words = self._words
        base = _HEADER_WORDS + slot * _SLOT_WORDS
        # calls first: a reader that sees the failure (read first) sees its call too.
        words[base + _CALLS] += 1
        if failed:
            words[base + _FAILURES] += 1
        if timed_out:
            words[base + _TIMEOUTS] += 1
        words[base + _LATENCY_MICROS] += max(0, int(seconds * 1_000_000))

    def add_answered(self, slot: int, seconds: float) -> None:
        """:meth:`add` for a call the store answered, the case of nearly every call."""
        words = self._words
        base = _HEADER_WORDS + slot * _SLOT_WORDS
        words[base + _CALLS] += 1
        micros = int(seconds * 1_000_000)
        if micros > 0:
            words[base + _LATENCY_MICROS] += micros

    def totals(self) -> Totals:
        """Every process's calls summed (read in the order that never shows a failure early)."""
        words = self._words
        failures = sum(words[_HEADER_WORDS + _FAILURES :: _SLOT_WORDS])
        timeouts = sum(words[_HEADER_WORDS + _TIMEOUTS :: _SLOT_WORDS])
        micros = sum(words[_HEADER_WORDS + _LATENCY_MICROS :: _SLOT_WORDS])
        calls = sum(words[_HEADER_WORDS + _CALLS :: _SLOT_WORDS])
        return Totals(calls=calls, failures=failures, timeouts=timeouts, latency=micros / 1e6)
