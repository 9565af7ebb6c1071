#!/usr/bin/env bash
# The vLLM engine's GPU check: one short run, prepared to finish in under 8 minutes on a one-GPU machine.
#
#   bash scripts/gpu_check.sh            # from anywhere; logs go to $OUT (the device tool's folder) or /tmp
#
# 1. Makes sure vLLM and rlfabric import, installing them into a venv over the system packages when they are
#    missing (vLLM brings the torch build it pins). Wheels in .whl/ are installed first, for a machine with no
#    network. Exit 3 when vLLM still cannot be imported.
# 2. Runs the GPU tests: python -m pytest -q -m gpu tests/test_vllm_engine.py
# 3. Prints a quick throughput and weight-update measurement on a ~130M-parameter random Qwen2 (built locally:
#    nothing is downloaded). RLF_EAGER=0 measures with CUDA graphs (adds about a minute of compilation).
#
# Exit status: the pytest run's (0 when every GPU test passed), 2 without a GPU, 3 without vLLM.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 TOKENIZERS_PARALLELISM=false
LOGS=${OUT:-/tmp/rlfabric-gpu-check}
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
start=$SECONDS

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no NVIDIA GPU here"; exit 2; }

if ! "$PY" -c "import vllm, rlfabric" 2>/dev/null; then
    venv=/tmp/rlfabric-vllm-venv
    [ -x "$venv/bin/python" ] || "$PY" -m venv --system-site-packages "$venv"
    PY=$venv/bin/python
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps .whl/*.whl || echo "installing .whl/ failed"
    fi
    "$PY" -c "import vllm" 2>/dev/null || timeout 200 "$PY" -m pip install -q "vllm>=0.11" || echo "pip install vllm failed"
    "$PY" -c "import rlfabric" 2>/dev/null || timeout 100 "$PY" -m pip install -q -e ".[test]" ||
        echo "pip install -e .[test] failed"
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
    echo "GPU CHECK NOT RUN: vLLM is not importable and could not be installed (no network, no .whl/ wheels?)"
    exit 3
fi
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__, torch.version.cuda)"
echo "setup took $((SECONDS - start)) s"

timeout 240 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_vllm_engine.py 2>&1 | tee "$LOGS/pytest.log"
tests=${PIPESTATUS[0]}
echo "tests took $((SECONDS - start)) s in all (exit $tests)"

timeout 120 "$PY" - <<'PYTHON' 2>&1 | tee "$LOGS/throughput.log"
import asyncio
import json
import os
import tempfile
import time

from rlfabric.engines.base import SamplingParams
from rlfabric.engines.vllm_engine import VLLMEngine
from rlfabric.models.hf import build_char_tokenizer, build_small_qwen2, save_pretrained

tokenizer = build_char_tokenizer()
model = build_small_qwen2(tokenizer, num_layers=8, hidden_size=1024, num_heads=16, max_positions=1024)
params_m = sum(p.numel() for p in model.parameters()) / 1e6
path = save_pretrained(model, tokenizer, tempfile.mkdtemp() + "/model")
eager = os.environ.get("RLF_EAGER", "1") != "0"
t0 = time.perf_counter()
engine = VLLMEngine(str(path), dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=1024, enforce_eager=eager)
startup = time.perf_counter() - t0
prompts = [tokenizer.encode(f"{i}+{i * 7 % 100}=", add_special_tokens=False) for i in range(512)]
params = SamplingParams(max_new_tokens=128, temperature=1.0)


async def main():
    await engine.generate(prompts[:16], params)  # warm-up
    t = time.perf_counter()
    completions = await engine.generate(prompts, params)
    gen_s = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for c in completions)
    t = time.perf_counter()
    await engine.load_weights(model.state_dict(), version=1)
    load_s = time.perf_counter() - t
    after = await engine.generate(prompts[:8], params)
    assert all(c.version == 1 for c in after)
    await engine.shutdown()
    return {
        "model_params_M": round(params_m, 1),
        "enforce_eager": eager,
        "engine_startup_s": round(startup, 1),
        "requests": len(prompts),
        "generated_tokens": tokens,
        "generate_s": round(gen_s, 2),
        "tokens_per_s": round(tokens / gen_s),
        "load_weights_s": round(load_s, 2),
        "load_weights_MB_bf16": round(sum(v.numel() * 2 for v in model.state_dict().values()) / 2**20),
    }


result = asyncio.run(main())
print("THROUGHPUT", json.dumps(result))
with open(os.path.join(os.environ.get("OUT") or "/tmp/rlfabric-gpu-check", "throughput.json"), "w") as f:
    json.dump(result, f)
PYTHON
echo "gpu check took $((SECONDS - start)) s"
exit "$tests"
