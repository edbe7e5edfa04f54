from setuptools import find_packages, setup

setup(
    name="jagg-grpo",
    version="0.1.0",
    license="Apache-2.0",
    description="GRPO for flow-matching text-to-image transformers, with JAGG group gradients",
    python_requires=">=3.10",
    packages=find_packages(include=["train*", "models*", "rewards*", "samplers*", "settings*", "configs*", "testbed*"]),
    # the shipped defaults, found through importlib.resources (train/parts/config/shipped.py): the configuration
    # tree, the architecture configs the planner reads, the testbed's pipeline and prompt lists
    package_data={
        "configs": ["*.yaml", "**/*.yaml", "arch/**/*.json"],
        "testbed": ["pipeline/**/*", "prompts/*.txt"],
    },
    install_requires=[
        "torch>=2.6",
        "torchvision>=0.21",
        "diffusers>=0.35",
        "transformers>=4.56",
        "accelerate>=1.0",
        "open_clip_torch>=2.24",
        "peft>=0.17",
        "wandb>=0.19",
        "hydra-core>=1.3",
        "safetensors>=0.4",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "httpx>=0.27,<1",  # the remote reward's client (rewards/remote.py)
    ],
    extras_require={
        "dev": ["pytest>=8", "ruff>=0.6", "mypy>=1.10"],
        # scripts/reward_server.py, on the machine that serves a reward model
        "server": ["fastapi>=0.110", "uvicorn>=0.29"],
    },
    # The commands as programs on PATH: Hydra's tab completion (eval "$(jagg-train -sc install=bash)")
    # completes a program's name, which "python -m train" is not.
    entry_points={
        "console_scripts": [
            "jagg-train=train.__main__:command",
            "jagg-eval=train.tools.eval.command:command",
            "jagg-compare=train.tools.compare.command:main",
            "jagg-probe=train.tools.probe.command:command",
            "jagg-plan=train.tools.plan.command:command",
            "jagg-preflight=train.tools.preflight.command:command",
        ]
    },
)
