import pytest
from bank import Account, InsufficientFunds


def test_transfer_moves_money():
    a, b = Account("a", 10), Account("b", 1)
    a.transfer(b, 4)
    assert (a.balance, b.balance) == (6, 5)


def test_failed_transfer_changes_nothing():
    a, b = Account("a", 10), Account("b", 1)
    with pytest.raises(InsufficientFunds):
        a.transfer(b, 50)
    assert (a.balance, b.balance) == (10, 1)
    assert a.history == [] and b.history == []


def test_transfer_to_self():
    a = Account("a", 10)
    with pytest.raises(ValueError):
        a.transfer(a, 1)


def test_error_type():
    assert issubclass(InsufficientFunds, Exception)
