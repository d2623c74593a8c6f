"""`hugeembed train --nproc N` on one machine: the processes' rendezvous store listens on 127.0.0.1 only (issue 31:
torchrun --standalone, which 78baa67 launched, hosts it on every interface)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from hugeembed.training import run_local

pytestmark = pytest.mark.dist

# Each rank joins the group through the launcher's store, all-reduces its rank + 1, and rank 0 reports
# which addresses listen on the store's port (MASTER_PORT), from /proc/net/tcp{,6} (state 0A: LISTEN).
WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    port = int(os.environ["MASTER_PORT"])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:
                listening.append(addr)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            f.write(f"{total.item()} {' '.join(listening)}")
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
@pytest.mark.slow
def test_the_store_of_a_local_launch_listens_on_loopback_only(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out.txt"
    assert run_local(2, [sys.executable, str(tmp_path / "worker.py"), str(out)]) == 0
    total, *addresses = out.read_text().split()
    assert float(total) == 3.0  # both ranks took part
    assert addresses == ["0100007F"], addresses  # 127.0.0.1 (little-endian hex), and nothing else


def test_a_failing_process_stops_the_launch_with_its_status(tmp_path, capfd):
    code = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
    assert run_local(2, [sys.executable, "-c", code]) == 3
    assert "hugeembed: rank 1 of 2 exited with status 3; stopping the other ranks" in capfd.readouterr().err
