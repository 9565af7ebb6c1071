#!/usr/bin/env bash
# Stand-ins for ray and gymnasium, for the GPU checks on a bare CUDA torch image (nothing there uses them):
#   bash scripts/gpu_check_stubs.sh DIR && PYTHONPATH=DIR python scripts/gpu_game_learner_check.py
set -euo pipefail
dir=${1:?usage: gpu_check_stubs.sh DIR}
mkdir -p "$dir/ray" "$dir/gymnasium"
cat > "$dir/ray/__init__.py" <<'PY'
import pickle as cloudpickle  # noqa: F401


class ObjectRef: ...


def remote(*args, **kwargs):
    return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda cls: cls)


def method(*args, **kwargs):
    return lambda f: f
PY
cat > "$dir/gymnasium/__init__.py" <<'PY'
from gymnasium import spaces  # noqa: F401


class Env: ...


class Wrapper(Env): ...


registry = {}
PY
cat > "$dir/gymnasium/spaces.py" <<'PY'
class Space: ...


class Box(Space): ...


class Discrete(Space): ...


class Dict(Space): ...
PY
