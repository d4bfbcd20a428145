from bank import Account


def test_history_order():
    acc = Account("a", 5)
    acc.deposit(2)
    acc.withdraw(1)
    assert acc.history == [("deposit", 2), ("withdraw", 1)]


def test_transfer_history_on_both_sides():
    a, b = Account("a", 5), Account("b")
    a.transfer(b, 3)
    assert a.history == [("transfer_out", 3)]
    assert b.history == [("transfer_in", 3)]


def test_opening_balance_not_in_history():
    assert Account("a", 100).history == []
