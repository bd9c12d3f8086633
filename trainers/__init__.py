"""Trainers: the agent GRPO base, the agent loop, and one small file per method.

`TRAINERS` maps the `trainer:` name of a config to its (Trainer, Config) pair; it is the project's only lookup table.
"""

from trainers.alignopsd import AlignOPSDConfig, AlignOPSDTrainer
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer
from trainers.beta_opsd import BetaOPSDConfig, BetaOPSDTrainer
from trainers.draco import DRACOConfig, DRACOTrainer
from trainers.funnel import FunnelConfig, FunnelTrainer
from trainers.gigpo import GiGPOConfig, GiGPOTrainer
from trainers.mpo import MPOConfig, MPOTrainer
from trainers.ppo import AgentPPOTrainer, PPOConfig
from trainers.taspo import TASPOConfig, TASPOTrainer
from trainers.xtree_trainer import XTreeConfig, XTreeTrainer

TRAINERS: dict[str, tuple[type, type]] = {
    "grpo": (AgentGRPOTrainer, AgentGRPOConfig),
    "draco": (DRACOTrainer, DRACOConfig),
    "gigpo": (GiGPOTrainer, GiGPOConfig),
    "taspo": (TASPOTrainer, TASPOConfig),
    "alignopsd": (AlignOPSDTrainer, AlignOPSDConfig),
    "beta_opsd": (BetaOPSDTrainer, BetaOPSDConfig),
    "funnel": (FunnelTrainer, FunnelConfig),
    "xtree": (XTreeTrainer, XTreeConfig),
    "ppo": (AgentPPOTrainer, PPOConfig),
    "mpo": (MPOTrainer, MPOConfig),
}

__all__ = ["TRAINERS", "AgentGRPOConfig", "AgentGRPOTrainer"]
