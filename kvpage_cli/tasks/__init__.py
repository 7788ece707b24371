"""The tasks: contract review and questions over documents, on the engine's forked contexts."""

from .ask import Asker
from .events import ReviewProgress
from .prompts import PromptError, render
from .review import Reviewer
from .playbook import Playbook, PlaybookError
from .schema import RISK_LEVELS, SCHEMA_VERSION, AskResult, Assessment, Finding, ReviewResult, Term, Value
from .taxonomy import CATEGORIES

__all__ = [
    "Asker",
    "AskResult",
    "Assessment",
    "CATEGORIES",
    "Finding",
    "Playbook",
    "PlaybookError",
    "PromptError",
    "RISK_LEVELS",
    "ReviewProgress",
    "ReviewResult",
    "Reviewer",
    "SCHEMA_VERSION",
    "Term",
    "Value",
    "render",
]
