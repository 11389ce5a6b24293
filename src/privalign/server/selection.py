"""Candidates and the selection among them: one backend call at a time per slot (at most
``max_concurrency`` at once), every candidate cut at the request's stop strings, scored by the
reward model, and selected by the request's mechanism (released-bon, PrivBoN or PrivITP, whose
Phase 2 is generated in chunks)."""

from __future__ import annotations

import dataclasses
import threading

from .. import mechanisms as M
from ..rewards import RewardModel, score_checked
from .config import ServiceConfig
from .openai_params import cut_at_stop


class Selector:
    """Generates, scores and selects for one request (``select``); counts its backend calls."""

    def __init__(self, cfg: ServiceConfig, generator, reward: RewardModel, sensitivity: float | None,
                 reward_range: tuple[float, float], max_concurrency: int):
        self.cfg, self.generator, self.reward = cfg, generator, reward
        self.sensitivity, self.range = sensitivity, reward_range
        self._backend_slots = threading.BoundedSemaphore(max_concurrency)
        self.backend_calls = 0  # generate() calls made (diagnostics, tests, benchmarks)
        self._count_lock = threading.Lock()

    def _generate(self, messages, k, max_tokens, temperature=None, usage: dict | None = None, stop=()):
        """One backend call; at most ``max_concurrency`` of them run at once (the others wait here).
        ``usage`` (prompt_tokens, completion_tokens) is updated with what the backend reports. Every
        candidate is cut at the first of the ``stop`` strings (finish_reason "stop") before anything
        scores it."""
        with self._backend_slots:
            with self._count_lock:
                self.backend_calls += 1
            out = self.generator.generate(messages, k, max_new_tokens=max_tokens or self.cfg.generator.max_new_tokens,
                                          temperature=temperature or self.cfg.generator.temperature)
        if stop:
            out = [g if not cut else dataclasses.replace(g, text=text, finish_reason="stop")
                   for g, (text, cut) in ((g, cut_at_stop(g.text, stop)) for g in out)]
        if usage is not None:
            usage["completion_tokens"] += sum(max(g.n_tokens, 0) for g in out)
            if not usage["prompt_tokens"] and out and out[0].prompt_tokens:
                usage["prompt_tokens"] = out[0].prompt_tokens
        return out

    def _scores(self, messages, texts):
        prompt = messages[-1]["content"]
        return score_checked(self.reward, [prompt] * len(texts), texts).scores

    def select(self, messages, o, max_tokens, temperature=None, usage: dict | None = None):
        """Generate, score and select. Returns (the selected Generation, selection, candidates generated).

        PrivITP's Phase 2 (at most T = ``max_rounds`` rounds) is generated in chunks: at most
        ``phase2_chunks`` backend calls of c = ceil(T / phase2_chunks) candidates, each chunk scored in
        one reward call. The first chunk rides with Phase 1's call (n + c samples of the same prompt);
        the last carries one extra sample, kept unscored for the fallback's fresh base-policy draw. So a
        query makes at most ``phase2_chunks`` backend calls and generates at most n + t + c (+ 1)
        candidates.

        Why this is sound (the privacy analysis is unchanged): every candidate is an independent draw
        of the base policy, which does not depend on the private data, whichever call produced it.
        ``privitp`` reads Phase 2's rewards strictly in order through ``next_reward`` and stops at the
        first acceptance; a chunk member after the accepted one has its reward computed but never
        read, and its text is never returned, so the selected text, the halting time and the charge
        have exactly the law of the one-at-a-time mechanism. The fallback text is a sample whose reward
        is never computed, drawn independently of all examined candidates, as the mechanism requires.
        ``candidates_generated`` reports every sample generated, a function of the halting time alone
        (which the response reports anyway).
        """
        n = o["n"]
        if o["mechanism"] == "released-bon":  # post-processing of the released head: no noise, no charge
            first = self._generate(messages, n, max_tokens, temperature, usage, o["stop"])
            sel = M.soft_bon(self._scores(messages, [g.text for g in first]), temperature=o["temperature"])
            return first[sel.index], dataclasses.replace(sel, mechanism="released-bon", epsilon=0.0), n
        if o["mechanism"] == "privbon":
            first = self._generate(messages, n, max_tokens, temperature, usage, o["stop"])
            r1 = self._scores(messages, [g.text for g in first])
            sel = M.privbon(r1, noise_scale=o["noise_scale"], sensitivity=self.sensitivity, reward_range=self.range,
                            noise=self.cfg.mechanism.privbon_noise)
            return first[sel.index], sel, n
        return self._privitp(messages, o, max_tokens, temperature, usage)

    def _privitp(self, messages, o, max_tokens, temperature, usage):
        """PrivITP with Phase 2 in chunks, read strictly in order (``select`` says why it is sound)."""
        n, T = o["n"], o["max_rounds"]
        c = -(-T // min(self.cfg.mechanism.phase2_chunks, T))  # Phase 2's chunk size, ceil(T / chunks)
        phase2: list = []            # Phase-2 candidates (Generations), in the order the mechanism examines them
        rewards: list[float] = []    # their rewards
        generated, fallback, examined = 0, None, 0

        def draw(k1: int, k2: int):
            """One backend call: k1 Phase-1 and k2 Phase-2 candidates (plus the fallback's draw when this
            chunk completes Phase 2), scored in one reward call; returns the Phase-1 scores."""
            nonlocal generated, fallback
            last = len(phase2) + k2 == T
            gens = self._generate(messages, k1 + k2 + last, max_tokens, temperature, usage, o["stop"])
            generated += len(gens)
            if last:
                fallback = gens[k1 + k2]  # never scored
            scores = self._scores(messages, [g.text for g in gens[:k1 + k2]])
            phase2.extend(gens[k1:k1 + k2])
            rewards.extend(float(r) for r in scores[k1:])
            return scores[:k1]

        r1 = draw(n, min(c, T))

        def next_reward():  # strictly in order; the next chunk only once every earlier one is examined
            nonlocal examined
            if examined == len(rewards):
                draw(0, min(c, T - len(phase2)))
            examined += 1
            return rewards[examined - 1]

        sel = M.privitp(r1, next_reward, beta=o["beta"], sigma_x=o["sigma_x"], sigma_z=o["sigma_z"], delta=o["delta"],
                        sensitivity=self.sensitivity, reward_range=self.range, max_rounds=T)
        if sel.fallback:  # every candidate was examined, so the last chunk, with the fallback's draw, was made
            return fallback, sel, generated
        return phase2[sel.index], sel, generated
