"""BFCL v4 multi-turn as an env (``agentenv/BFCL-v0``), from the ``bfcl-eval`` package."""

from envs.bfcl.data import CATEGORIES, load_category
from envs.bfcl.env import BFCLEnv

__all__ = ["CATEGORIES", "BFCLEnv", "load_category"]
