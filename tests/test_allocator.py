"""rlfabric.allocator: a step that frees and re-allocates its buffers stops faulting their pages in again."""

from __future__ import annotations

import subprocess
import sys

# A "step" allocates 40 x 1 MiB of tensors, touches them and frees them; ten steps after a first one, the page faults
# they took. Without the call glibc hands the top of its heap back to the kernel after each step and faults it in
# again in the next (about 1,000 pages a step here).
SCRIPT = """
import resource, sys, torch
from rlfabric.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def step():
    blocks = [torch.empty(2**18).fill_(1.0) for _ in range(40)]
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    return int(out.stdout.split()[-1])


def test_retained_memory_is_reused_without_page_faults():
    default = page_faults("default")
    assert default > 5_000  # the pattern does fault with glibc's defaults
    assert page_faults("retain") < default / 10


def test_an_allocator_the_user_chose_is_left_alone(monkeypatch):
    from rlfabric.allocator import retain_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert retain_freed_memory() is False
