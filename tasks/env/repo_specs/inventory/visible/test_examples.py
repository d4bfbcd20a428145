from inventory import Inventory


def test_add_example():
    inv = Inventory()
    inv.add("apple", 3, price=2)
    assert inv.quantity("apple") == 3


def test_value_example():
    inv = Inventory()
    inv.add("pen", 2, price=5)
    assert inv.total_value() == 10
