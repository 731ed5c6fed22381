"""The README's seed example under `iris dev` as root, with the clusters' own defaults (the job
sandbox on, run_as = "nobody"): the job runs the venv's `python` (which links under a 0700 /root
here), prints its output, and reports a uid other than 0; `iris peers` shows each process backend's
sandbox (docs/SECURITY.md, "The job sandbox")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from devprocess import DevProcess
from stack import free_port_config

from iris import devstack
from iris.config import PROJECT_ROOT, load_config

SEED = PROJECT_ROOT / "examples" / "seed"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the README's examples as root"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


@pytest.mark.timeout(400)
async def test_the_seed_example_runs_sandboxed_as_a_pool_uid(tmp_path: Path) -> None:
    cfg = free_port_config(load_config(), f"127.0.0.1:{devstack.free_port()}")
    defaults = load_config()
    for c in cfg.clusters:  # the test stack's own choice undone: the config's defaults
        c.run_as, c.sandbox = defaults.cluster(c.name).run_as, defaults.cluster(c.name).sandbox
    assert {c.sandbox for c in cfg.clusters} == {"auto"}
    config_file = tmp_path / "dev-config.json"
    config_file.write_text(cfg.model_dump_json())
    dev = DevProcess(
        config_file,
        tmp_path / "data",
        "--worker-metrics",
        f"127.0.0.1:{devstack.free_port()}",
        "--temporal-metrics-port",
        str(devstack.free_port()),
    )
    await dev.start()
    try:
        code, out, err = await dev.iris(
            "job", "run", "--device-type=h100", "--gpu-count=8", "my_training_script.py", cwd=SEED
        )
        assert code == 0, err
        assert "step 3: loss" in out and "trained on cw-" in out, (out, err)
        code, out, err = await dev.iris("job", "run", "--job-name", "whoami", "--", "python", "-c",
            "import os, sys; print('uid', os.getuid(), sys.executable)", cwd=tmp_path,
        )  # fmt: skip
        assert code == 0, err
        uid = int(out.split("uid ", 1)[1].split()[0])
        pool = cfg.home_cluster.sandbox_uid_range
        assert uid != 0 and uid in pool, out
        code, out, err = await dev.iris("peers", cwd=tmp_path)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split()[-1] == "SANDBOX", out
        assert all(line.rstrip().endswith("bwrap") for line in lines[1:] if line.strip()), out
    finally:
        assert await dev.stop() == 0, "".join(dev.output)
