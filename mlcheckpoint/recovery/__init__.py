"""Layer 4: inventory -> plan -> fetch -> verify -> load -> heal (resume.py, top to bottom)."""

from .inventory import NodeInventory, StepCopy, take_inventory
from .planner import Decision, Fetch, plan_resume
from .resume import Recovery, ResumeInfo

__all__ = ["Decision", "Fetch", "NodeInventory", "Recovery", "ResumeInfo", "StepCopy",
           "plan_resume", "take_inventory"]
