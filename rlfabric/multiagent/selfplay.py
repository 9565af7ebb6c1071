"""Self-play bookkeeping: Elo ratings and the opponent pool of frozen snapshots of the learning policy.

Pure Python (no Ray, no torch): the run keeps one ``OpponentPool``, asks it whether to take a snapshot after each
policy version (``should_add``), hands its sampling distribution to the rollout workers (``probabilities``: a plain
``{snapshot id: probability}`` dict, sampled per episode with ``sample_from``), records each finished game's result
(``record``), and saves ``state_dict()`` in its checkpoints.

A game's **score** is the learner's result: 1 for a win, 0.5 for a draw, 0 for a loss (``game_score`` turns two
returns into one). A **win rate** here is the mean score, so a draw counts half a win.

Elo (Elo 1978; the FIDE convention of a 400-point scale): the expected score of A against B is
``E_A = 1 / (1 + 10 ** ((R_B - R_A) / 400))`` and after one game with A's score ``S_A`` both ratings move by the same
amount in opposite directions, ``R_A += K (S_A - E_A)``, ``R_B -= K (S_A - E_A)``. The learner has one rating
(``learner_elo``); each snapshot starts at the learner's rating when it was taken and moves only through the
learner's games against it.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rlfabric.config_base import ConfigError, require

SAMPLING_MODES = ("uniform", "recency", "pfsp")
_STATE_FORMAT = 1


class UnitRandom(Protocol):
    """What sampling needs of a random generator: ``random()`` uniform on [0, 1) (``numpy.random.Generator`` and
    ``random.Random`` both qualify)."""

    def random(self) -> float: ...


# ---------------------------------------------------------------------------------------------------------
# Elo


def elo_expected(r_a: float, r_b: float) -> float:
    """A's expected score against B: ``E_A = 1 / (1 + 10 ** ((r_b - r_a) / 400))``.

    Equal ratings give 0.5; a 400-point lead gives 10/11.
    """
    return 1.0 / (1.0 + 10.0 ** ((r_b - r_a) / 400.0))


def elo_update(r_a: float, r_b: float, score_a: float, k: float) -> tuple[float, float]:
    """Both ratings after one game in which A scored ``score_a`` (1 win, 0.5 draw, 0 loss):
    ``d = k * (score_a - elo_expected(r_a, r_b))``, returns ``(r_a + d, r_b - d)`` (the sum is conserved).
    """
    d = k * (score_a - elo_expected(r_a, r_b))
    return r_a + d, r_b - d


def game_score(learner_return: float, opponent_return: float) -> float:
    """The learner's score in one two-player game from the two players' returns: 1 if the learner's return is
    higher, 0 if lower, 0.5 if equal (a draw)."""
    if learner_return > opponent_return:
        return 1.0
    if learner_return < opponent_return:
        return 0.0
    return 0.5


# ---------------------------------------------------------------------------------------------------------
# Sampling distributions over snapshots (oldest first)


def recency_weights(n: int) -> list[float]:
    """Probabilities of ``n`` snapshots ordered oldest to newest, proportional to rank:
    ``p_i = i / (n (n + 1) / 2)`` for ``i = 1 .. n`` (the newest is n times as likely as the oldest)."""
    total = n * (n + 1) / 2
    return [i / total for i in range(1, n + 1)]


def pfsp_win_probability(wins: int, draws: int, losses: int) -> float:
    """The learner's estimated chance of beating a snapshot, from its record against it with one prior win and one
    prior loss: ``x = (wins + 0.5 draws + 1) / (games + 2)`` (0.5 with no games, never 0 or 1)."""
    return (wins + 0.5 * draws + 1.0) / (wins + draws + losses + 2.0)


def pfsp_weights(win_probabilities: list[float], power: float) -> list[float]:
    """Prioritized fictitious self-play (AlphaStar, Vinyals et al. 2019, "hard" weighting): snapshot i is sampled
    with probability proportional to ``f(x_i) = (1 - x_i) ** power``, where ``x_i`` is the learner's chance of
    beating it, so the opponents it still loses to come up most; ``power = 0`` is uniform."""
    raw = [(1.0 - x) ** power for x in win_probabilities]
    total = sum(raw)
    return [w / total for w in raw]


def sample_from(probabilities: Mapping[int, float], rng: UnitRandom) -> int:
    """One key of ``probabilities`` (id -> probability, summing to 1) drawn by inverse CDF with one ``rng.random()``;
    keys are taken in the mapping's order."""
    if not probabilities:
        raise ValueError("sample_from: no snapshot to sample from (the opponent pool is empty)")
    u = float(rng.random())
    acc = 0.0
    last = 0
    for key, p in probabilities.items():
        acc += p
        last = key
        if u < acc:
            return key
    return last  # rounding left the total a hair under u


# ---------------------------------------------------------------------------------------------------------
# The pool


@dataclass
class Snapshot:
    """One frozen copy of the learning policy. ``weights`` is whatever the caller stored (never looked at);
    ``version`` the policy version it was taken at; ``elo`` its rating; ``wins``/``draws``/``losses`` the
    learner's results against it."""

    id: int
    version: int
    weights: Any
    elo: float
    wins: int = 0
    draws: int = 0
    losses: int = 0

    @property
    def games(self) -> int:
        return self.wins + self.draws + self.losses


class OpponentPool:
    """Frozen snapshots of the learning policy for it to play against, with Elo ratings and game counts.

    Triggers for a new snapshot (``should_add``; either one fires, at least one must be set):
    ``snapshot_every`` versions since the last snapshot; or the learner's win rate over its last
    ``win_rate_window`` games reaching ``win_rate_threshold``, once ``min_games`` games have been played since the
    last snapshot (``min_games >= win_rate_window`` makes the window see only games against the current pool).
    At most ``max_size`` snapshots are kept, the oldest dropped first. ``sampling`` picks an opponent:
    ``"uniform"``, ``"recency"`` (``recency_weights``) or ``"pfsp"`` (``pfsp_weights`` with ``pfsp_power``).
    ``elo_k`` is the Elo K-factor; the learner starts at ``initial_elo``.
    """

    def __init__(
        self,
        *,
        snapshot_every: int | None,
        win_rate_threshold: float | None,
        win_rate_window: int,
        min_games: int,
        max_size: int,
        sampling: str,
        pfsp_power: float,
        elo_k: float,
        initial_elo: float = 1000.0,
    ) -> None:
        _check_settings(
            snapshot_every=snapshot_every,
            win_rate_threshold=win_rate_threshold,
            win_rate_window=win_rate_window,
            min_games=min_games,
            max_size=max_size,
            sampling=sampling,
            pfsp_power=pfsp_power,
            elo_k=elo_k,
            initial_elo=initial_elo,
        )
        self.snapshot_every = snapshot_every
        self.win_rate_threshold = win_rate_threshold
        self.win_rate_window = win_rate_window
        self.min_games = min_games
        self.max_size = max_size
        self.sampling = sampling
        self.pfsp_power = float(pfsp_power)
        self.elo_k = float(elo_k)
        self.initial_elo = float(initial_elo)

        self.learner_elo = float(initial_elo)
        self._snapshots: dict[int, Snapshot] = {}  # oldest first (insertion order)
        self._next_id = 0
        self._recent: deque[float] = deque(maxlen=win_rate_window)  # the learner's last scores against the pool
        self.games_since_snapshot = 0
        self.last_snapshot_version: int | None = None
        self.total_games = 0

    # -- contents --------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def ids(self) -> list[int]:
        """Current snapshot ids, oldest first."""
        return list(self._snapshots)

    @property
    def snapshots(self) -> list[Snapshot]:
        """Current snapshots, oldest first."""
        return list(self._snapshots.values())

    def __getitem__(self, snapshot_id: int) -> Snapshot:
        try:
            return self._snapshots[snapshot_id]
        except KeyError:
            raise KeyError(f"opponent pool: no snapshot {snapshot_id!r}; current ids: {self.ids}") from None

    def weights(self, snapshot_id: int) -> Any:
        """The weights stored with ``snapshot_id``, exactly as given to ``add``."""
        return self[snapshot_id].weights

    # -- growing ---------------------------------------------------------------------------------------------

    def should_add(self, version: int, recent_win_rate: float | None = None) -> bool:
        """Whether to snapshot the learner now, at policy ``version``.

        True when the pool is empty; when ``snapshot_every`` is set and ``version - last snapshot's version >=
        snapshot_every``; or when ``win_rate_threshold`` is set, ``games_since_snapshot >= min_games`` and the win
        rate (``recent_win_rate``, or ``self.win_rate()`` when None) is ``>= win_rate_threshold``.
        """
        if not self._snapshots:
            return True
        if self.snapshot_every is not None and self.last_snapshot_version is not None:
            if version - self.last_snapshot_version >= self.snapshot_every:
                return True
        if self.win_rate_threshold is not None and self.games_since_snapshot >= self.min_games:
            rate = self.win_rate() if recent_win_rate is None else recent_win_rate
            if rate is not None and rate >= self.win_rate_threshold:
                return True
        return False

    def add(self, weights: Any, version: int) -> int:
        """Store a snapshot of the learner (``weights`` kept as given) taken at policy ``version``, rated at the
        learner's current Elo; drop the oldest beyond ``max_size``. Returns the new snapshot's id (ids count up
        from 0 and are never reused)."""
        sid = self._next_id
        self._next_id += 1
        self._snapshots[sid] = Snapshot(id=sid, version=int(version), weights=weights, elo=self.learner_elo)
        while len(self._snapshots) > self.max_size:
            del self._snapshots[next(iter(self._snapshots))]
        self.games_since_snapshot = 0
        self.last_snapshot_version = int(version)
        return sid

    # -- sampling --------------------------------------------------------------------------------------------

    def probabilities(self) -> dict[int, float]:
        """The sampling distribution over current snapshot ids (oldest first) by ``sampling``: a plain dict of
        Python ints to floats summing to 1 (empty when the pool is)."""
        snaps = self.snapshots
        n = len(snaps)
        if n == 0:
            return {}
        if self.sampling == "uniform":
            probs = [1.0 / n] * n
        elif self.sampling == "recency":
            probs = recency_weights(n)
        else:
            xs = [pfsp_win_probability(s.wins, s.draws, s.losses) for s in snaps]
            probs = pfsp_weights(xs, self.pfsp_power)
        return {s.id: p for s, p in zip(snaps, probs, strict=True)}

    def sample(self, rng: UnitRandom) -> int:
        """One snapshot id drawn from ``probabilities()`` with ``rng`` (anything with ``random()`` on [0, 1))."""
        if not self._snapshots:
            raise ValueError("opponent pool is empty: add a snapshot before sampling an opponent")
        return sample_from(self.probabilities(), rng)

    # -- results ---------------------------------------------------------------------------------------------

    def record(self, snapshot_id: int, score: float) -> bool:
        """Record one game of the learner against ``snapshot_id`` with the learner's ``score`` (1 win, 0.5 draw,
        0 loss): it counts toward the win rate, the snapshot's wins/draws/losses, and both Elo ratings
        (``elo_update``). A snapshot evicted while the game was played counts toward the win rate only (its rating
        is gone); returns whether the snapshot was still in the pool."""
        if score not in (0, 0.5, 1):
            raise ValueError(f"OpponentPool.record: score = {score!r} is not valid: expected 1 (win), 0.5 or 0")
        try:
            sid = operator.index(snapshot_id)
        except TypeError:
            sid = -1
        if not 0 <= sid < self._next_id:
            raise KeyError(f"OpponentPool.record: no snapshot {snapshot_id!r} was ever added; current ids: {self.ids}")
        score = float(score)
        self._recent.append(score)
        self.games_since_snapshot += 1
        self.total_games += 1
        snap = self._snapshots.get(sid)
        if snap is None:
            return False
        if score == 1.0:
            snap.wins += 1
        elif score == 0.0:
            snap.losses += 1
        else:
            snap.draws += 1
        self.learner_elo, snap.elo = elo_update(self.learner_elo, snap.elo, score, self.elo_k)
        return True

    def win_rate(self, window: int | None = None) -> float | None:
        """The learner's mean score over its last ``window`` games against the pool (default and maximum
        ``win_rate_window``; fewer if fewer were played); None before the first game."""
        if window is None:
            window = self.win_rate_window
        if not isinstance(window, int) or not 1 <= window <= self.win_rate_window:
            raise ValueError(
                f"OpponentPool.win_rate: window = {window!r} is not valid: "
                f"expected an integer from 1 to self_play.win_rate_window = {self.win_rate_window}"
            )
        if not self._recent:
            return None
        recent = list(self._recent)[-window:]
        return sum(recent) / len(recent)

    def metrics(self) -> dict[str, float]:
        """Numbers to log each step: learner Elo, pool size, the win rate over the window (NaN before any game),
        the mean, lowest and highest snapshot Elo, and the newest snapshot's policy version."""
        elos = [s.elo for s in self._snapshots.values()]
        rate = self.win_rate()
        return {
            "learner_elo": self.learner_elo,
            "pool_size": float(len(self._snapshots)),
            "pool_win_rate": math.nan if rate is None else rate,
            "pool_elo_mean": sum(elos) / len(elos) if elos else math.nan,
            "pool_elo_min": min(elos) if elos else math.nan,
            "pool_elo_max": max(elos) if elos else math.nan,
            "pool_newest_version": math.nan
            if self.last_snapshot_version is None
            else float(self.last_snapshot_version),
        }

    # -- checkpoints -----------------------------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The constructor's keyword arguments this pool was built with."""
        return {
            "snapshot_every": self.snapshot_every,
            "win_rate_threshold": self.win_rate_threshold,
            "win_rate_window": self.win_rate_window,
            "min_games": self.min_games,
            "max_size": self.max_size,
            "sampling": self.sampling,
            "pfsp_power": self.pfsp_power,
            "elo_k": self.elo_k,
            "initial_elo": self.initial_elo,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this pool, as plain data plus the stored weights objects themselves (not
        copied; a checkpoint that outlives the Ray cluster must store values, not object refs)."""
        return {
            "format": _STATE_FORMAT,
            "settings": self.settings(),
            "learner_elo": self.learner_elo,
            "next_id": self._next_id,
            "snapshots": [
                {
                    "id": s.id,
                    "version": s.version,
                    "weights": s.weights,
                    "elo": s.elo,
                    "wins": s.wins,
                    "draws": s.draws,
                    "losses": s.losses,
                }
                for s in self._snapshots.values()
            ],
            "recent": list(self._recent),
            "games_since_snapshot": self.games_since_snapshot,
            "last_snapshot_version": self.last_snapshot_version,
            "total_games": self.total_games,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], **settings: Any) -> OpponentPool:
        """The pool ``state_dict()`` described. Keyword ``settings`` override the saved ones (a resumed run may
        change e.g. ``sampling``); a smaller ``max_size`` drops the oldest snapshots, a smaller
        ``win_rate_window`` the oldest recent games."""
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"opponent pool state: format = {got!r} is not valid: expected {_STATE_FORMAT}")
        try:
            merged = {**state["settings"], **settings}
            pool = cls(**merged)
            pool.learner_elo = float(state["learner_elo"])
            pool._next_id = int(state["next_id"])
            for s in state["snapshots"]:
                pool._snapshots[int(s["id"])] = Snapshot(
                    id=int(s["id"]),
                    version=int(s["version"]),
                    weights=s["weights"],
                    elo=float(s["elo"]),
                    wins=int(s["wins"]),
                    draws=int(s["draws"]),
                    losses=int(s["losses"]),
                )
            pool._recent.extend(float(x) for x in state["recent"])
            pool.games_since_snapshot = int(state["games_since_snapshot"])
            last = state["last_snapshot_version"]
            pool.last_snapshot_version = None if last is None else int(last)
            pool.total_games = int(state["total_games"])
        except KeyError as e:
            raise ValueError(f"opponent pool state: missing key {e.args[0]!r}") from None
        while len(pool._snapshots) > pool.max_size:
            del pool._snapshots[next(iter(pool._snapshots))]
        return pool


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_settings(
    *,
    snapshot_every: Any,
    win_rate_threshold: Any,
    win_rate_window: Any,
    min_games: Any,
    max_size: Any,
    sampling: Any,
    pfsp_power: Any,
    elo_k: Any,
    initial_elo: Any,
) -> None:
    """One ``ConfigError`` (a ValueError) naming the first bad ``self_play.<name>``, its value and what is allowed."""
    p = "self_play."
    require(
        snapshot_every is None or (_is_int(snapshot_every) and snapshot_every >= 1),
        p + "snapshot_every",
        snapshot_every,
        "expected null or an integer >= 1 (policy versions between snapshots)",
    )
    require(
        win_rate_threshold is None or (_is_number(win_rate_threshold) and 0 < win_rate_threshold <= 1),
        p + "win_rate_threshold",
        win_rate_threshold,
        "expected null or a number in (0, 1]",
    )
    if snapshot_every is None and win_rate_threshold is None:
        raise ConfigError(
            "self_play.snapshot_every and self_play.win_rate_threshold are both null: set one or both, "
            "or the pool never grows past its first snapshot"
        )
    require(
        _is_int(win_rate_window) and win_rate_window >= 1,
        p + "win_rate_window",
        win_rate_window,
        "expected an integer >= 1",
    )
    require(_is_int(min_games) and min_games >= 0, p + "min_games", min_games, "expected an integer >= 0")
    require(_is_int(max_size) and max_size >= 1, p + "max_size", max_size, "expected an integer >= 1")
    require(sampling in SAMPLING_MODES, p + "sampling", sampling, "expected one of " + ", ".join(SAMPLING_MODES))
    require(_is_number(pfsp_power) and pfsp_power >= 0, p + "pfsp_power", pfsp_power, "expected a number >= 0")
    require(_is_number(elo_k) and elo_k > 0, p + "elo_k", elo_k, "expected a number > 0")
    require(_is_number(initial_elo), p + "initial_elo", initial_elo, "expected a finite number")
