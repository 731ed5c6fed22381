"""`iris dev --backend slurm` (issue 30): the demo with both CoreWeave peers on one single-node Slurm
that iris dev starts under its data directory and stops with the stack. The seed's example runs there
as ``nobody`` and sees Slurm's GPUs; `iris peers` says how the Slurm peers' jobs are isolated; after
Ctrl-C nothing of that Slurm is left."""

from __future__ import annotations

from pathlib import Path

import pytest
from devprocess import DevProcess
from stack import free_port_config

from iris import devstack, slurmdev
from iris.config import PROJECT_ROOT, load_config

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(400)]

SEED = PROJECT_ROOT / "examples" / "seed"


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line or environment names ``text``."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def test_iris_dev_backend_slurm_runs_the_seed_example_on_its_own_slurm(tmp_path: Path) -> None:
    why = slurmdev.unavailable()
    if why is not None:
        pytest.skip(why)
    base = load_config(PROJECT_ROOT / "config" / "clusters-slurm.toml")
    cfg = free_port_config(base, f"127.0.0.1:{devstack.free_port()}")
    config_file = tmp_path / "dev-config.json"
    config_file.write_text(cfg.model_dump_json())
    data = tmp_path / "data"
    dev = DevProcess(
        config_file,
        data,
        "--backend",
        "slurm",
        "--worker-metrics",
        f"127.0.0.1:{devstack.free_port()}",
        "--temporal-metrics-port",
        str(devstack.free_port()),
    )
    await dev.start()
    try:
        printed = "".join(dev.output)
        assert "Slurm" in printed and "slurmctld 127.0.0.1:" in printed, printed
        conf = next(data.glob("clusters-slurm.json"))
        code, out, err = await dev.iris(
            "job", "run", "--device-type=h100", "--gpu-count=8", "my_training_script.py", cwd=SEED
        )
        assert code == 0, err
        assert "step 3: loss" in out, (out, err)
        line = next(x for x in out.splitlines() if x.startswith("trained on cw-"))
        assert len(line.rsplit("devices ", 1)[1].rstrip(")").split(",")) == 8, line
        code, out, err = await dev.iris("peers", cwd=tmp_path)
        assert code == 0, err
        slurm_rows = [row for row in out.splitlines() if "h100" in row]
        assert len(slurm_rows) == 2 and all(
            row.rstrip().endswith("slurm: as nobody (uid 65534)") for row in slurm_rows
        ), out
    finally:
        assert await dev.stop() == 0, "".join(dev.output)
    # Nothing of its Slurm is left: no daemon, no job, no runtime directory.
    slurm_root = str(data / "slurm")
    assert _processes_naming(slurm_root) == []
    runtime = slurmdev.SlurmCluster(slurmdev.SlurmSpec(gres={}), data / "slurm").runtime
    assert _processes_naming(str(runtime)) == [] and not runtime.exists()
    assert conf.exists()
