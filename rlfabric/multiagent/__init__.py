"""Multi-agent games: PettingZoo envs, per-agent spaces, policy mapping, self-play."""
