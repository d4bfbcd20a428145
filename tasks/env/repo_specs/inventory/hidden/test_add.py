import pytest
from inventory import Inventory


def test_add_accumulates():
    inv = Inventory()
    inv.add("nail", 10, price=1)
    inv.add("nail", 5)
    assert inv.quantity("nail") == 15 and len(inv) == 1


def test_new_price_replaces_old():
    inv = Inventory()
    inv.add("nail", 1, price=1)
    inv.add("nail", 1, price=3)
    assert inv.price("nail") == 3


def test_first_add_needs_price():
    with pytest.raises(ValueError):
        Inventory().add("bolt", 1)


def test_bad_quantity_or_price():
    inv = Inventory()
    for q in (0, -2, 1.5, True):
        with pytest.raises(ValueError):
            inv.add("x", q, price=1)
    with pytest.raises(ValueError):
        inv.add("x", 1, price=-1)


def test_names_sorted_and_unknown_quantity():
    inv = Inventory()
    inv.add("pear", 1, price=1)
    inv.add("apple", 1, price=1)
    assert inv.names() == ["apple", "pear"]
    assert inv.quantity("kiwi") == 0
