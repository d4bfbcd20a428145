from bank.errors import InsufficientFunds


def _check(amount):
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
        raise ValueError("amount must be a positive number")


class Account:
    def __init__(self, owner, balance=0):
        if isinstance(balance, bool) or not isinstance(balance, (int, float)) or balance < 0:
            raise ValueError("opening balance must be a number >= 0")
        self.owner = owner
        self._balance = balance
        self.history = []

    @property
    def balance(self):
        return self._balance

    def deposit(self, amount, _kind="deposit"):
        _check(amount)
        self._balance += amount
        self.history.append((_kind, amount))

    def withdraw(self, amount, _kind="withdraw"):
        _check(amount)
        if amount > self._balance:
            raise InsufficientFunds(f"{self.owner} has {self._balance}, needs {amount}")
        self._balance -= amount
        self.history.append((_kind, amount))

    def transfer(self, to, amount):
        if to is self:
            raise ValueError("cannot transfer to the same account")
        self.withdraw(amount, _kind="transfer_out")
        to.deposit(amount, _kind="transfer_in")
