"""Cross-request batching: concurrent calls to one embedded model merged into one batched call.

An embedded model answers one service request at a time unless requests are merged: each request
batches only its own n samples, and small batches waste most of a CPU's decoding throughput (see
docs/benchmarks.md). ``BatchingGenerator`` and ``BatchingReward`` put every call in a queue; one
worker thread takes the first waiting call, collects more for at most ``max_wait_ms`` (or until
``max_batch`` sequences are waiting), and answers the whole group with one batched call to the
underlying model. Each caller gets its own results back, in order. When a merged call raises, its
members are run again one by one, so that only a call that fails on its own gets the error: one
request's bad input (a prompt that breaks a tokenizer or a reward model) never fails, and so never
charges at its worst case, another request merged with it. A retried member is a fresh call (a
generation draws fresh samples); nothing it returns depends on the failed attempt. The queue logic
is written once, in ``Batcher``.

Both wrappers are thread-safe (the model itself is only ever called from the worker thread), so a
service may call them from as many request threads as it likes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future

import numpy as np

from ..rewards.base import RewardModel


class _Item:
    __slots__ = ("arrived", "future", "key", "payload", "size")

    def __init__(self, key, payload, size: int):
        self.key, self.payload, self.size, self.future = key, payload, size, Future()
        self.arrived = time.monotonic()


class Batcher:
    """A queue and one worker thread that runs ``run(key, payloads) -> results`` on groups of calls.

    ``submit(key, payload, size)`` blocks until the payload's result is ready and returns it (or
    raises what ``run`` raised). Calls with equal ``key`` may be merged (up to ``max_batch``
    sequences; ``size`` counts a payload's sequences, and a call larger than ``max_batch`` runs
    alone); a call with key ``Batcher.ALONE`` never merges. A batch leaves at most ``max_wait_ms``
    after its oldest call arrived, or as soon as ``max_batch`` sequences are waiting; calls that
    queued up while the previous batch ran have waited long enough and leave at once, together.
    """

    ALONE = object()

    def __init__(self, run: Callable[[Hashable, list], list], max_batch: int = 64, max_wait_ms: float = 5.0,
                 name: str = "privalign-batcher"):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        self.run, self.max_batch, self.max_wait = run, int(max_batch), float(max_wait_ms) / 1000.0
        self.name = name
        self._queue: list[_Item] = []
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        self.batches = 0  # successful calls of ``run`` (each answering one group; for tests and benchmarks)
        self.retried = 0  # calls run again alone after their merged call failed

    def submit(self, key, payload, size: int = 1):
        item = _Item(key, payload, max(int(size), 1))
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._worker.start()
            self._queue.append(item)
            self._cond.notify_all()
        return item.future.result()

    def close(self) -> None:
        """Stop the worker once the queue is empty; later calls raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self) -> list[_Item] | None:
        """The next group to run: waits for a first call, then up to max_wait for more."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            deadline = self._queue[0].arrived + self.max_wait
            while sum(i.size for i in self._queue) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            head = self._queue[0]
            if head.key is Batcher.ALONE:
                self._queue.pop(0)
                return [head]
            group, rest, total = [], [], 0
            for item in self._queue:
                # same key, within max_batch (the first call always goes, however large)
                fits = not group or total + item.size <= self.max_batch
                if item.key is not Batcher.ALONE and item.key == head.key and fits:
                    group.append(item)
                    total += item.size
                else:
                    rest.append(item)
            self._queue = rest
            return group

    def _call(self, key, group: list[_Item]) -> list:
        results = self.run(key, [i.payload for i in group])
        if len(results) != len(group):
            raise RuntimeError(f"batched call returned {len(results)} results for {len(group)} calls")
        self.batches += 1
        return results

    def _loop(self) -> None:
        while True:
            group = self._take()
            if group is None:
                return
            try:
                results = self._call(group[0].key, group)
            except Exception as e:
                if len(group) == 1:
                    group[0].future.set_exception(e)
                    continue
                # a merged call failed: each member alone, so the failure stays with whoever causes it
                self.retried += len(group)
                for i in group:
                    try:
                        i.future.set_result(self._call(i.key, [i])[0])
                    except BaseException as e1:
                        i.future.set_exception(e1)
                continue
            except BaseException as e:  # not an error of one call (interpreter exit): every caller sees it
                for i in group:
                    i.future.set_exception(e)
                raise
            for i, r in zip(group, results):
                i.future.set_result(r)


class BatchingGenerator:
    """A thread-safe ``Generator`` whose concurrent ``generate`` calls share batched decoding.

    Calls with the same (max_new_tokens, temperature) are merged into one
    ``generator.generate_many([(messages, k), ...])`` call; a backend without ``generate_many``
    (llama.cpp's high-level API) gets its ``generate`` called once per request, serially, on the
    worker thread. A call with a ``seed`` (or any backend-specific option) runs on its own, so
    seeded research runs stay reproducible.
    """

    def __init__(self, generator, max_batch: int = 64, max_wait_ms: float = 5.0):
        self.generator = generator
        self.name = getattr(generator, "name", type(generator).__name__)
        # thread-safe: the service may send this many calls at once (more than max_batch gain nothing)
        self.max_concurrency = int(max_batch)
        self.batcher = Batcher(self._run, max_batch, max_wait_ms, name="privalign-generate-batcher")

    def generate(self, messages: list[dict], k: int, *, max_new_tokens: int = 256, temperature: float = 1.0,
                 seed: int | None = None, **options):
        """k samples for one chat prompt (the ``Generator`` protocol), batched with concurrent calls."""
        if seed is not None or options:
            key = Batcher.ALONE
        else:
            key = (int(max_new_tokens), float(temperature))
        payload = (messages, int(k), dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, **options))
        return self.batcher.submit(key, payload, size=k)

    def _run(self, key, payloads):
        many = getattr(self.generator, "generate_many", None)
        if key is Batcher.ALONE or many is None or len(payloads) == 1:
            return [self.generator.generate(m, k, **kw) for m, k, kw in payloads]
        max_new_tokens, temperature = key
        out = many([(m, k) for m, k, _ in payloads], max_new_tokens=max_new_tokens, temperature=temperature)
        for (_, k, _), got in zip(payloads, out):
            if len(got) != k:
                raise RuntimeError(f"generate_many returned {len(got)} samples for a request of {k}")
        return out

    def close(self) -> None:
        self.batcher.close()

    def __getattr__(self, attr):  # anything else (tokenizer, featurize, ...) is the wrapped generator's
        if attr in ("generator", "batcher"):
            raise AttributeError(attr)
        return getattr(self.generator, attr)


class BatchingReward(RewardModel):
    """A thread-safe ``RewardModel`` whose concurrent ``score`` calls are merged into one call.

    ``name``, ``output_range`` and ``sensitivity`` read and write the wrapped model's own
    attributes; any other attribute (``certificate``, ``w``, ...) is the wrapped model's too.
    """

    def __init__(self, model: RewardModel, max_batch: int = 64, max_wait_ms: float = 5.0):
        self.model = model
        self.batcher = Batcher(self._run, max_batch, max_wait_ms, name="privalign-score-batcher")

    name = property(lambda self: self.model.name, lambda self, v: setattr(self.model, "name", v))
    output_range = property(lambda self: self.model.output_range,
                            lambda self, v: setattr(self.model, "output_range", v))
    sensitivity = property(lambda self: self.model.sensitivity,
                           lambda self, v: setattr(self.model, "sensitivity", v))

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        prompts, responses = list(prompts), list(responses)
        if len(prompts) != len(responses):
            raise ValueError(f"prompts and responses must have the same length, got {len(prompts)} "
                             f"and {len(responses)}")
        if not prompts:
            return np.zeros(0)
        return self.batcher.submit(None, (prompts, responses), size=len(prompts))

    def _run(self, key, payloads):
        if len(payloads) == 1:
            return [np.asarray(self.model.score(*payloads[0]))]
        prompts = [p for ps, _ in payloads for p in ps]
        responses = [r for _, rs in payloads for r in rs]
        scores = np.asarray(self.model.score(prompts, responses))
        if scores.shape[:1] != (len(prompts),):
            raise ValueError(f"reward model {self.model.name!r} returned shape {scores.shape}, "
                             f"expected ({len(prompts)},)")
        bounds = np.cumsum([0] + [len(ps) for ps, _ in payloads]).tolist()
        return [scores[a:b] for a, b in itertools.pairwise(bounds)]

    def close(self) -> None:
        self.batcher.close()

    def __getattr__(self, attr):
        if attr in ("model", "batcher"):
            raise AttributeError(attr)
        return getattr(self.model, attr)
