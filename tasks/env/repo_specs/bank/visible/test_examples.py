from bank import Account


def test_deposit_example():
    acc = Account("ann", 10)
    acc.deposit(5)
    assert acc.balance == 15


def test_history_example():
    acc = Account("bob")
    acc.deposit(3)
    assert acc.history == [("deposit", 3)]
