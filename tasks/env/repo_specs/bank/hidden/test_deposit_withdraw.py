import pytest
from bank import Account, InsufficientFunds


def test_withdraw():
    acc = Account("ann", 10)
    acc.withdraw(4)
    assert acc.balance == 6


def test_overdraw_refused():
    acc = Account("ann", 10)
    with pytest.raises(InsufficientFunds):
        acc.withdraw(11)
    assert acc.balance == 10


def test_bad_amounts():
    acc = Account("ann", 10)
    for amount in (0, -5, "3", None):
        with pytest.raises(ValueError):
            acc.deposit(amount)
        with pytest.raises(ValueError):
            acc.withdraw(amount)


def test_opening_balance():
    assert Account("x").balance == 0
    with pytest.raises(ValueError):
        Account("x", -1)


def test_balance_is_read_only():
    acc = Account("ann", 1)
    with pytest.raises(AttributeError):
        acc.balance = 100
