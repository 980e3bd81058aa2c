"""cli.keep_freed_memory, which every program calls through cli.main: freed blocks stay in the
process, so a forward that allocates and frees the same activations again faults in (almost) no
fresh pages. Counted in fresh processes, one with glibc's default and one with the setting: page
faults are counts the kernel keeps, not timings."""
import json
import subprocess
import sys

import pytest

from tests.test_layout import ROOT

# a layer's worth of activations, three times per pass: blocks above glibc's largest mapping
# threshold (32 MB) go back to the kernel at every free by default
PASSES = """
import json, resource, sys, torch, cli
kept = cli.keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        a = torch.ones(3 * 2**20)   # 12 MB
        b = torch.ones(10 * 2**20)  # 40 MB
        c = a * 2
        del a
        d = torch.ones(2**20)
        del b, c, d
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
faults()  # the first pass maps what the process needs
print(json.dumps(dict(kept=kept, faults=sum(faults() for _ in range(3)))))
"""


def passes(mode):
    out = subprocess.run([sys.executable, "-c", PASSES, mode], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_freed_memory_is_reused_not_faulted_in_again():
    default, keep = passes("default"), passes("keep")
    if not keep["kept"]:
        pytest.skip("not glibc: keep_freed_memory changes nothing here")
    # by default every 40 MB block is mapped afresh: 10,240 pages, 9 times
    assert default["faults"] >= 9 * 10240, default
    assert keep["faults"] < default["faults"] / 4, (keep, default)
