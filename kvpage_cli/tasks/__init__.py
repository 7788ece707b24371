"""The tasks: contract review and questions over documents, on the engine's forked contexts."""

from .ask import Asker
from .events import ReviewProgress
from .prompts import PromptError, render
from .review import Reviewer
from .schema import CATEGORIES, RISK_LEVELS, SCHEMA_VERSION, AskResult, Finding, ReviewResult

__all__ = [
    "Asker",
    "AskResult",
    "CATEGORIES",
    "Finding",
    "PromptError",
    "RISK_LEVELS",
    "ReviewProgress",
    "ReviewResult",
    "Reviewer",
    "SCHEMA_VERSION",
    "render",
]
