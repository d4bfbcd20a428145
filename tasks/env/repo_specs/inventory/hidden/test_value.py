from inventory import Inventory


def test_empty_value():
    assert Inventory().total_value() == 0


def test_value_of_several_items():
    inv = Inventory()
    inv.add("a", 2, price=3)
    inv.add("b", 5, price=0.5)
    assert inv.total_value() == 8.5


def test_value_after_changes():
    inv = Inventory()
    inv.add("a", 2, price=3)
    inv.add("a", 1, price=4)
    inv.remove("a", 1)
    assert inv.total_value() == 8
