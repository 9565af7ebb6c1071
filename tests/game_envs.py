"""Games for the tests: tic-tac-toe that raises on a move its action mask forbids."""

from __future__ import annotations

import pettingzoo


class IllegalMoveGuard(pettingzoo.utils.BaseWrapper):
    """Raises on a move the action mask forbids (tic-tac-toe itself would end the game with a -1 for the mover,
    so an illegal move would pass unseen)."""

    def step(self, action):
        if action is not None and not self.observe(self.agent_selection)["action_mask"][action]:
            raise RuntimeError(f"illegal move {action} by {self.agent_selection}")
        super().step(action)


def guarded_tictactoe():
    return IllegalMoveGuard(pettingzoo.make("aec", "classic/tictactoe-v3"))
