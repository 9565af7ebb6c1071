"""Fixed baseline players for turn-based board games: what a self-play learner's win rate is measured against.

Each takes what a policy sees, the observation and the action mask (nonzero = legal), and returns an action index;
the ``*_batch`` forms take a batch along the first axis and return an int64 array.

``random_player`` plays uniformly over the legal actions of any masked game. ``tictactoe_scripted`` plays
PettingZoo's ``classic.tictactoe_v3``: win if it can, else block the opponent's immediate win, else the centre, else
a corner, else the lowest legal cell. That env's observation is a (3, 3, 2) int8 board from the acting player's
view, plane 0 its own marks and plane 1 the opponent's, built as ``board.squares`` reshaped to (3, 3) in C order, so
cell ``k`` (the action index) is ``observation[k // 3, k % 3]``; the flat 18-vector of the same array (C order, as
Gymnasium flattens it) has cell ``k`` at positions ``2k`` (own) and ``2k + 1`` (opponent). Both shapes are taken.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlfabric import shipping
from rlfabric.multiagent.spaces import AgentSpaces

# The eight lines of three cells in action-index space (pettingzoo.classic.tictactoe.board.Board.winning_combinations).
TICTACTOE_LINES: tuple[tuple[int, int, int], ...] = (
    (0, 1, 2),
    (3, 4, 5),
    (6, 7, 8),
    (0, 3, 6),
    (1, 4, 7),
    (2, 5, 8),
    (0, 4, 8),
    (2, 4, 6),
)
TICTACTOE_CENTRE = 4
TICTACTOE_CORNERS = (0, 2, 6, 8)


def random_player(mask: np.ndarray, rng: np.random.Generator) -> int:
    """A legal action drawn uniformly: ``legal[rng.integers(len(legal))]`` with ``legal = flatnonzero(mask)``."""
    legal = np.flatnonzero(np.asarray(mask).reshape(-1))
    if legal.size == 0:
        raise ValueError("random_player: the action mask has no legal action")
    return int(legal[rng.integers(legal.size)])


def random_player_batch(masks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``random_player`` for each row of ``masks`` [B, A]: with ``n`` legal actions in a row and ``u`` uniform on
    [0, 1), the ``floor(u n)``-th legal action (0-based, in index order)."""
    legal = np.asarray(masks).reshape(len(masks), -1) != 0
    counts = legal.sum(axis=1)
    if (counts == 0).any():
        rows = np.flatnonzero(counts == 0).tolist()
        raise ValueError(f"random_player_batch: rows {rows} of the action mask have no legal action")
    k = np.minimum((rng.random(len(counts)) * counts).astype(np.int64), counts - 1)
    # The first index whose running count of legal actions exceeds k.
    return np.argmax(np.cumsum(legal, axis=1) > k[:, None], axis=1).astype(np.int64)


def _tictactoe_cells(observation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    board = np.asarray(observation)
    if board.size != 18:
        raise ValueError(
            f"tictactoe_scripted: observation of shape {board.shape} is not a tictactoe_v3 board: "
            "expected (3, 3, 2) or 18 values"
        )
    cells = board.reshape(9, 2) != 0
    return cells[:, 0], cells[:, 1]


def _completing_cell(marks: np.ndarray, legal: np.ndarray) -> int | None:
    """The lowest legal cell that completes a line in which ``marks`` holds the other two cells, if any."""
    found = [c for line in TICTACTOE_LINES if marks[list(line)].sum() == 2 for c in line if legal[c] and not marks[c]]
    return min(found) if found else None


def tictactoe_scripted(observation: np.ndarray, mask: np.ndarray) -> int:
    """The scripted tic-tac-toe move: a cell completing one of its own lines (win), else one completing an
    opponent's line (block), else the centre, else a corner (lowest index first), else the lowest legal cell."""
    own, opp = _tictactoe_cells(observation)
    legal = np.asarray(mask).reshape(-1) != 0
    if legal.shape != (9,):
        raise ValueError(f"tictactoe_scripted: action mask of shape {np.shape(mask)} is not valid: expected 9 values")
    if not legal.any():
        raise ValueError("tictactoe_scripted: the action mask has no legal action")
    for marks in (own, opp):
        cell = _completing_cell(marks, legal)
        if cell is not None:
            return cell
    for cell in (TICTACTOE_CENTRE, *TICTACTOE_CORNERS):
        if legal[cell]:
            return cell
    return int(np.flatnonzero(legal)[0])


def tictactoe_scripted_batch(observations: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """``tictactoe_scripted`` for each row of ``observations`` [B, 3, 3, 2] or [B, 18] and ``masks`` [B, 9]."""
    obs = np.asarray(observations)
    return np.array([tictactoe_scripted(o, m) for o, m in zip(obs, np.asarray(masks), strict=True)], dtype=np.int64)


def _shipped_or_imported(name: str, shipped: dict[str, Any], what: str) -> Any:
    """``shipped[name]``, else the function ``name`` ("package.module:function") imports, else a ValueError."""
    if name in shipped:
        return shipped[name]
    fn = shipping.import_callable(name)
    if fn is None:
        known = " or ".join(repr(k) for k in shipped)
        raise ValueError(f"{what} {name!r}: not {known} and not an importable 'package.module:function'")
    return fn


def scripted_rule(rule: str) -> Any:
    """A scripted policy's rule, ``rule(observations [B, D], masks [B, A] or Nones) -> B actions``: a shipped one
    by name ("tictactoe"), or ``package.module:function``."""
    return _shipped_or_imported(rule, {"tictactoe": tictactoe_scripted_batch}, "scripted rule")


def rule_misfit(rule: Any, spaces: AgentSpaces, raw_obs: Any) -> str | None:
    """Why ``rule`` (resolved by ``scripted_rule``) cannot play an agent with ``spaces``, tried on one of its raw
    observations: what it raised, or the move it returned that is not one legal action; None when it can."""
    obs, mask = spaces.encode(raw_obs)
    if mask is not None and not mask.any():  # no move is legal for it now: nothing to try the rule on
        return None
    try:
        actions = np.asarray(rule(obs[None], mask[None] if mask is not None else [None]))
    except Exception as exc:  # noqa: BLE001 - the rule's own failure, reported with its words
        return f"{type(exc).__name__}: {exc}"
    if actions.shape[:1] != (1,):
        return f"it returned {actions.shape[0] if actions.ndim else 'no'} actions for 1 observation"
    move = actions[0]
    if spaces.action.kind == "discrete" and not (
        np.ndim(move) == 0 and 0 <= int(move) < spaces.action.n and (mask is None or mask[int(move)])
    ):
        shown = int(move) if np.ndim(move) == 0 and np.issubdtype(np.asarray(move).dtype, np.integer) else move
        return f"it returned {shown!r}, not one of the {spaces.action.n} actions its mask allows"
    return None


def tictactoe_text(observation: np.ndarray, mask: np.ndarray | None) -> str:
    """A tic-tac-toe observation as text for a language model: the board row by row from the mover's side
    (``x`` its marks, ``o`` the opponent's, ``.`` empty; cell k is row k // 3, column k % 3), then the legal
    cells, then ``move:``."""
    mine, theirs = _tictactoe_cells(observation)
    cells = ["x" if mine[k] else "o" if theirs[k] else "." for k in range(9)]
    rows = "\n".join("".join(cells[3 * r : 3 * r + 3]) for r in range(3))
    legal = " ".join(str(k) for k in range(9) if mask is None or mask[k])
    return f"{rows}\nlegal: {legal}\nmove:"


def text_renderer(render: str) -> Any:
    """An llm policy's renderer, ``render(observation, mask) -> str``: a shipped one by name ("tictactoe"), or
    ``package.module:function``."""
    return _shipped_or_imported(render, {"tictactoe": tictactoe_text}, "renderer")


def random_policy_return(env: Any, episodes: int, seed: int = 0) -> float:
    """The mean, over ``episodes`` seeded episodes of a PettingZoo Parallel ``env``, of the per-agent return when
    every agent acts uniformly at random (each agent's action space sampled): the baseline a learning curve is read
    against."""
    for agent in env.possible_agents:
        env.action_space(agent).seed(seed + env.possible_agents.index(agent))
    returns = []
    for episode in range(episodes):
        env.reset(seed=seed + episode)
        total = dict.fromkeys(env.agents, 0.0)
        while env.agents:
            _, rewards, _, _, _ = env.step({a: env.action_space(a).sample() for a in env.agents})
            for agent, reward in rewards.items():
                total[agent] = total.get(agent, 0.0) + float(reward)
        returns.append(float(np.mean(list(total.values()))))
    return float(np.mean(returns))
