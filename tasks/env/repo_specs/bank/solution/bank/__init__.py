from bank.account import Account
from bank.errors import InsufficientFunds

__all__ = ["Account", "InsufficientFunds"]
