"""Token budgets: FULL graphs of packed items (encoders), and the packing of items into them.

``TokenBudgets`` is the ladder of budgets (the capture sizes of an
encoder's graphs) with a bound on items per pack; ``TokenBudgets.pack``
assigns item lengths to budgets, returning the ``Pack`` of each forward.
Never imports torch.
"""

from ._budgets import Pack as Pack
from ._budgets import TokenBudgets as TokenBudgets

__all__ = ["Pack", "TokenBudgets"]
