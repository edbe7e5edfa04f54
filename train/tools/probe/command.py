"""``python -m train.probe`` (``jagg-probe``): the gradient quality of a JAGG path per group (the
paper's Table 5) and the jagg_frac it gives, on the configured backbone, sampler and reward (session.py).

    python -m train.probe probe.num_rollouts=8                  # the CPU testbed
    torchrun --nproc_per_node 8 -m train.probe experiment=flux_dance model.path=... \\
        data.train_prompts=... reward.components.hpsv2.checkpoint=... reward.components.clipscore.model_path=...

Each probe writes into its own folder, ``runs/<experiment>/probe/<time>`` (configs/probe.yaml).
"""

from __future__ import annotations

from train.cli.command import hydra_command
from train.cli.compose import setup
from train.tools.probe.probe_config import register
from train.tools.probe.session import run_probe

PROG = "python -m train.probe"
setup()
register()
main, command = hydra_command("probe", PROG, run_probe)  # python -m train.probe, the console script jagg-probe


if __name__ == "__main__":
    command()
