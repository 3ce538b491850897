"""Layer 4: inventory -> plan -> fetch -> verify -> load -> heal (resume.py, top to bottom)."""

from .planner import Decision, Fetch, NodeInventory, plan_resume
from .resume import Recovery, ResumeInfo

__all__ = ["Decision", "Fetch", "NodeInventory", "Recovery", "ResumeInfo", "plan_resume"]
